"""specserve's GGUF parser against gguf-py's GGUFReader, and its refusal of damaged files."""
from __future__ import annotations

import math
import struct

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES

from specserve.errors import ModelFormatError
from specserve.model.gguf_file import GGUFFile

def test_smollm2_equals_gguf_reader(smollm2_path):
    # GGUFReader takes 3 s here and 9 s on each Qwen, whose vocabulary is three times larger:
    # only the small model is compared with it.
    ours, reader = GGUFFile(smollm2_path), gguf.GGUFReader(smollm2_path)
    expected = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for name, value in expected.items():
        assert ours.metadata[name] == value and type(ours.metadata[name]) is type(value), name
    assert list(ours.tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.shape == tuple(int(n) for n in tensor.shape), tensor.name
        assert mine.tensor_type is tensor.tensor_type, tensor.name
        assert (mine.data.dtype, mine.data.shape) == (tensor.data.dtype, tensor.data.shape), tensor.name
        assert np.array_equal(mine.data, tensor.data), tensor.name
        assert not mine.data.flags.writeable  # a view of the file, as GGUFReader's


def test_vocabulary_and_tensor_sizes_are_consistent(smollm2_path):
    """The parsed lists and block sizes agree with each other (the Qwen2.5 files in models/, which
    CI does not have, were checked so by hand: their 151,936-entry lists are the slow case)."""
    model = GGUFFile(smollm2_path)
    vocab_rows = model.tensors["token_embd.weight"].shape[-1]
    assert len(model.metadata["tokenizer.ggml.tokens"]) == vocab_rows
    assert len(model.metadata["tokenizer.ggml.token_type"]) == vocab_rows
    assert all(" " in merge for merge in model.metadata["tokenizer.ggml.merges"])
    for tensor in model.tensors.values():
        block_size, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        assert tensor.data.nbytes == math.prod(tensor.shape) // block_size * block_bytes, tensor.name


# Cut inside the magic, the header, the token strings, the tensor infos and the weights.
@pytest.mark.parametrize("length", [3, 16, 100_000, 1_780_000, 50_000_000, -1])
def test_truncated_file_is_refused(smollm2_path, tmp_path, length):
    with open(smollm2_path, "rb") as source:
        content = source.read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(content[:length])
    with pytest.raises(ModelFormatError, match="cut.gguf"):
        GGUFFile(str(path))


def test_wrong_magic_is_refused(tmp_path):
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"GGML" + struct.pack("<IQQ", 3, 0, 0))
    with pytest.raises(ModelFormatError, match="magic.gguf is not a GGUF file"):
        GGUFFile(str(path))


def test_unknown_version_is_refused(tmp_path):
    path = tmp_path / "future.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 4, 0, 0))
    with pytest.raises(ModelFormatError, match="future.gguf is GGUF version 4"):
        GGUFFile(str(path))
