"""The few-row matmul (gemm_rows.py) equals F.linear with the unfused pre-norm, SiLU * up
and RoPE + KV write, for 2..16 rows and every tile config the engine may pick (Triton's
interpreter on the CPU, fp32)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch

from specserve.model import gemm_rows, gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("config", gemm_rows.CANDIDATES)
@pytest.mark.parametrize("m,n,k", [(2, 37, 300), (16, 64, 256), (5, 6, 40)])
def test_rows_match_linear(config, m, n, k):
    torch.manual_seed(m + n + k)
    x, w, bias = torch.randn(m, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    for b in (None, bias):
        torch.testing.assert_close(gemm_rows.gemm_rows(x, w, b, config=config), gemv.reference(x, w, b, False),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", gemm_rows.CANDIDATES[:2])
@pytest.mark.parametrize("silu_mul,bias", [(False, True), (True, False)])
def test_rows_with_add_norm_match_add_rmsnorm_then_linear(config, silu_mul, bias):
    """Each row normalised on its own; residual + x written out for every row, the input left alone."""
    torch.manual_seed(4)
    m, k, n = 7, 300, 2 * 37
    x, residual = torch.randn(m, k, device=DEVICE), torch.randn(m, k, device=DEVICE) * torch.arange(1, m + 1, device=DEVICE)[:, None]
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w, b = torch.randn(n, k, device=DEVICE), (torch.randn(n, device=DEVICE) if bias else None)
    out, residual_out = gemm_rows.gemm_rows(x, w, b, silu_mul, config, add_norm=norm)
    expected, expected_residual = gemv.reference(x, w, b, silu_mul, add_norm=norm)
    assert out.shape == expected.shape == (m, n // 2 if silu_mul else n)
    torch.testing.assert_close(residual_out, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(residual, norm.residual)


@pytest.mark.parametrize("config", gemm_rows.CANDIDATES[:2])
@pytest.mark.parametrize("add_norm", [False, True])
def test_rows_with_rope_match_linear_then_rope_and_store(config, add_norm):
    """Each row rotated at its own position and written to its own slot; other slots untouched."""
    from specserve.model.layers import RotaryEmbedding
    torch.manual_seed(5)
    m, num_q, num_kv, head_dim, k = 3, 3, 1, 16, 48
    x = torch.randn(m, k, device=DEVICE)
    w, b = torch.randn((num_q + 2 * num_kv) * head_dim, k, device=DEVICE), torch.randn(80, device=DEVICE)
    norm = gemv.AddNorm(torch.randn(m, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    tables = RotaryEmbedding(head_dim, 10, 10000.0, None).to(DEVICE)
    pools = [torch.randn(8, num_kv, head_dim, device=DEVICE) for _ in range(2)]
    untouched = [p.clone() for p in pools]
    positions, slots = torch.tensor([7, 2, 9], device=DEVICE), torch.tensor([4, 1, 6], device=DEVICE)
    rope, expected_rope = (gemv.RopeStore(tables.cos, tables.sin, positions, slots, k_pool, v_pool, num_q)
                           for k_pool, v_pool in (pools, [p.clone() for p in pools]))
    out = gemm_rows.gemm_rows(x, w, b, config=config, add_norm=norm, rope=rope)
    expected = gemv.reference(x, w, b, False, add_norm=norm, rope=expected_rope)
    if add_norm:
        (out, residual_out), (expected, expected_residual) = out, expected
        torch.testing.assert_close(residual_out, expected_residual)
    assert out.shape == (m, num_q * head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    for written, reference, before in zip((rope.k_buffer, rope.v_buffer), (expected_rope.k_buffer, expected_rope.v_buffer),
                                          untouched):
        torch.testing.assert_close(written, reference, rtol=1e-4, atol=1e-4)
        assert not torch.equal(written[[4, 1, 6]], before[[4, 1, 6]])
        torch.testing.assert_close(written[[0, 2, 3, 5, 7]], before[[0, 2, 3, 5, 7]], rtol=0, atol=0)


def test_more_rows_than_the_tile_are_refused():
    x, w = torch.randn(gemm_rows.MAX_ROWS + 1, 32), torch.randn(16, 32)
    with pytest.raises(AssertionError, match="MAX_ROWS"):
        gemm_rows.gemm_rows(x, w)
