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


@pytest.mark.parametrize("config", gemv.CANDIDATES[:3])
@pytest.mark.parametrize("add_norm", [False, True])
def test_gemv_with_rope_matches_linear_then_rope_and_store(config, add_norm):
    """The qkv epilogue: q rotated and returned, k rotated and v copied into the token's
    slot of the KV pool (grouped-query: 3 q heads share 1 kv head); other slots untouched."""
    from specserve.model.layers import RotaryEmbedding
    torch.manual_seed(5)
    num_q, num_kv, head_dim, k = 3, 1, 16, 48
    x = torch.randn(1, k, device=DEVICE)
    w, b = torch.randn((num_q + 2 * num_kv) * head_dim, k, device=DEVICE), torch.randn(80, device=DEVICE)
    norm = gemv.AddNorm(torch.randn(1, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    tables = RotaryEmbedding(head_dim, 10, 10000.0, None).to(DEVICE)
    pools = [torch.randn(6, num_kv, head_dim, device=DEVICE) for _ in range(2)]
    untouched = [p.clone() for p in pools]
    position, slot = torch.tensor([7], device=DEVICE), torch.tensor([4], device=DEVICE)
    rope, expected_rope = (gemv.RopeStore(tables.cos, tables.sin, position, slot, k_pool, v_pool, num_q)
                           for k_pool, v_pool in (pools[:2], [p.clone() for p in pools[:2]]))
    out = gemv.gemv(x, w, b, config=config, add_norm=norm, rope=rope)
    expected = gemv.reference(x, w, b, False, add_norm=norm, rope=expected_rope)
    if add_norm:
        (out, residual_out), (expected, expected_residual) = out, expected
        torch.testing.assert_close(residual_out, expected_residual)
    assert out.shape == (1, num_q * head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.k_buffer, expected_rope.k_buffer, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.v_buffer, expected_rope.v_buffer, rtol=1e-4, atol=1e-4)
    for written, before in zip((rope.k_buffer, rope.v_buffer), untouched):
        assert not torch.equal(written[4], before[4])
        torch.testing.assert_close(written[[0, 1, 2, 3, 5]], before[[0, 1, 2, 3, 5]], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_batch1_decoder_path_matches_the_batched_path(arch, monkeypatch):
    """DecoderLayer's one-row path (the pre-norms inside the GEMVs, RoPE + KV write in the
    qkv GEMV; Qwen3's q/k norms keep the separate RoPE) gives the batched path's logits
    for a decode step after a prefill, and leaves the same K/V in the pool."""
    from specserve.model import layers, llama
    from specserve.runner import model_runner
    from tests.model_fixtures import RunnerDriver, tiny_hf_model
    monkeypatch.setattr(model_runner, "use_cpu_linears", lambda model: None)  # GPU weight layout: row-major
    hf = tiny_hf_model(arch)
    drivers = [RunnerDriver.from_hf(hf) for _ in range(2)]
    for driver in drivers:
        driver.prefill([5, 17, 3, 9, 44, 2])
    expected = drivers[0].decode(11)
    for module in (layers, llama):
        monkeypatch.setattr(module, "takes_row_kernels", lambda x: x.shape[0] == 1)
    monkeypatch.setattr(llama, "takes_one_row_kernels", lambda x: x.shape[0] == 1)  # the lm_head GEMV
    monkeypatch.setattr(gemv, "best_config", lambda *args: gemv.CANDIDATES[0])
    got = drivers[1].decode(11)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for pools in zip(drivers[0].runner.pool.k_buffers + drivers[0].runner.pool.v_buffers,
                     drivers[1].runner.pool.k_buffers + drivers[1].runner.pool.v_buffers):
        torch.testing.assert_close(*pools, rtol=1e-5, atol=1e-5)
