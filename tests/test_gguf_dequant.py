"""gguf_dequant's torch block formats against gguf-py's numpy dequantizers, bit for bit."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as numpy_dequantize

from specserve.model import gguf_dequant

BLOCK_FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _random_rows(type_name: str, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes of `rows` rows of blocks, with every float16 field a finite value
    (random bytes there would make inf * 0 = NaN, which says nothing about the format)."""
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    halves = {"Q6_K": [208]}.get(type_name, [0, 2] if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])
    for offset in halves:
        raw[:, offset:offset + 2] = rng.uniform(-2, 2, size=(len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("type_name", BLOCK_FORMATS)
def test_block_formats_equal_gguf_numpy(type_name):
    block_size, _ = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = _random_rows(type_name, rows=6, blocks_per_row=3, seed=BLOCK_FORMATS.index(type_name))
    expected = numpy_dequantize(raw, GGMLQuantizationType[type_name]).reshape(6, 3 * block_size)
    got = gguf_dequant.dequantize(raw, type_name, (6, 3 * block_size), "cpu")
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0


@pytest.mark.parametrize("type_name,dtype", [("F32", np.float32), ("F16", np.float16)])
def test_plain_formats(type_name, dtype):
    values = np.random.default_rng(0).standard_normal((4, 10)).astype(dtype)
    got = gguf_dequant.dequantize(values, type_name, (4, 10), "cpu")
    np.testing.assert_array_equal(got.numpy(), values.astype(np.float32))


def test_bf16_bytes():
    values = torch.randn(3, 8).to(torch.bfloat16)
    raw = values.view(torch.uint8).numpy()
    got = gguf_dequant.dequantize(raw, "BF16", (3, 8), "cpu")
    assert torch.equal(got, values.float())


def test_unknown_format_is_left_to_gguf():
    assert gguf_dequant.dequantize(np.zeros((1, 66), np.uint8), "IQ2_XXS", (1, 256), "cpu") is None
