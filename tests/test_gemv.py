"""The one-row GEMV kernel equals F.linear (and the unfused SiLU * up) for every tile
config the engine may pick (Triton's interpreter on the CPU, fp32; real sizes on a GPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch

from specserve.model import gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("config", gemv.CANDIDATES)
@pytest.mark.parametrize("n,k", [(37, 300), (64, 256), (6, 2100)])
def test_gemv_matches_linear(config, n, k):
    torch.manual_seed(n + k)
    x, w, bias = torch.randn(1, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    for b in (None, bias):
        torch.testing.assert_close(gemv.gemv(x, w, b, config=config), gemv.reference(x, w, b, False),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", gemv.CANDIDATES[:2])
def test_gemv_silu_mul_matches_unfused(config):
    torch.manual_seed(3)
    x, w = torch.randn(1, 200, device=DEVICE), torch.randn(2 * 45, 200, device=DEVICE)
    out = gemv.gemv(x, w, None, silu_mul=True, config=config)
    assert out.shape == (1, 45)
    torch.testing.assert_close(out, gemv.reference(x, w, None, True), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", gemv.CANDIDATES[:3])
@pytest.mark.parametrize("silu_mul,bias", [(False, True), (True, False)])
def test_gemv_with_add_norm_matches_add_rmsnorm_then_linear(config, silu_mul, bias):
    """The pre-norm inside the GEMV: residual + x written out, rmsnorm(residual + x) * w as input."""
    torch.manual_seed(4)
    k, n = 300, 2 * 37
    x, residual = torch.randn(1, k, device=DEVICE), torch.randn(1, k, device=DEVICE)
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w, b = torch.randn(n, k, device=DEVICE), (torch.randn(n, device=DEVICE) if bias else None)
    out, residual_out = gemv.gemv(x, w, b, silu_mul, config, add_norm=norm)
    expected, expected_residual = gemv.reference(x, w, b, silu_mul, add_norm=norm)
    torch.testing.assert_close(residual_out, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(residual, norm.residual)  # the input residual is left alone
