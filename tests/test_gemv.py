"""The few-row GEMV kernel equals F.linear (and the unfused SiLU * up, pre-norm, RoPE and KV
write) for every tile config the engine may pick and 1 to 8 rows (Triton's interpreter on
the CPU, fp32; real sizes on a GPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch

from specserve.model import gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("config,rows", [(c, 1) for c in gemv.CANDIDATES] + [(c, r) for c in gemv.FEW_ROW_CANDIDATES
                                                                             for r in (2, 3, 8)])
@pytest.mark.parametrize("n,k", [(37, 300), (64, 256), (6, 2100)])
def test_gemv_matches_linear(config, rows, n, k):
    torch.manual_seed(n + k)
    x, w, bias = torch.randn(rows, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    for b in (None, bias):
        torch.testing.assert_close(gemv.gemv(x, w, b, config=config), gemv.reference(x, w, b, False),
                                   rtol=1e-4, atol=1e-4)


ONE_AND_FEW_ROWS = [(gemv.CANDIDATES[0], 1), (gemv.CANDIDATES[1], 1), (gemv.FEW_ROW_CANDIDATES[0], 3),
                    (gemv.FEW_ROW_CANDIDATES[2], 5), (gemv.FEW_ROW_CANDIDATES[4], 8)]


@pytest.mark.parametrize("config,rows", ONE_AND_FEW_ROWS)
def test_gemv_silu_mul_matches_unfused(config, rows):
    torch.manual_seed(3)
    x, w = torch.randn(rows, 200, device=DEVICE), torch.randn(2 * 45, 200, device=DEVICE)
    out = gemv.gemv(x, w, None, silu_mul=True, config=config)
    assert out.shape == (rows, 45)
    torch.testing.assert_close(out, gemv.reference(x, w, None, True), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config,rows", ONE_AND_FEW_ROWS)
@pytest.mark.parametrize("silu_mul,bias", [(False, True), (True, False)])
def test_gemv_with_add_norm_matches_add_rmsnorm_then_linear(config, silu_mul, bias, rows):
    """The pre-norm inside the GEMV: residual + x written out, rmsnorm(residual + x) * w as
    input, each row normalised on its own."""
    torch.manual_seed(4)
    k, n = 300, 2 * 37
    x, residual = torch.randn(rows, k, device=DEVICE), torch.randn(rows, k, device=DEVICE) * torch.arange(
        1, rows + 1, device=DEVICE)[:, None]
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w, b = torch.randn(n, k, device=DEVICE), (torch.randn(n, device=DEVICE) if bias else None)
    out, residual_out = gemv.gemv(x, w, b, silu_mul, config, add_norm=norm)
    expected, expected_residual = gemv.reference(x, w, b, silu_mul, add_norm=norm)
    torch.testing.assert_close(residual_out, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(residual, norm.residual)  # the input residual is left alone


@pytest.mark.parametrize("config,rows", [c for c in ONE_AND_FEW_ROWS if c[1] <= 3] + [(gemv.FEW_ROW_CANDIDATES[3], 3)])
@pytest.mark.parametrize("add_norm", [False, True])
def test_gemv_with_rope_matches_linear_then_rope_and_store(config, add_norm, rows):
    """The qkv epilogue: q rotated and returned, k rotated and v copied into each row's
    slot of the KV pool at the row's position (grouped-query: 3 q heads share 1 kv head);
    other slots untouched."""
    from specserve.model.layers import RotaryEmbedding
    torch.manual_seed(5)
    num_q, num_kv, head_dim, k = 3, 1, 16, 48
    x = torch.randn(rows, k, device=DEVICE)
    w, b = torch.randn((num_q + 2 * num_kv) * head_dim, k, device=DEVICE), torch.randn(80, device=DEVICE)
    norm = gemv.AddNorm(torch.randn(rows, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    tables = RotaryEmbedding(head_dim, 10, 10000.0, None).to(DEVICE)
    pools = [torch.randn(6, num_kv, head_dim, device=DEVICE) for _ in range(2)]
    untouched = [p.clone() for p in pools]
    position, slot = torch.tensor([7, 2, 9][:rows], device=DEVICE), torch.tensor([4, 0, 2][:rows], device=DEVICE)
    rope, expected_rope = (gemv.RopeStore(tables.cos, tables.sin, position, slot, k_pool, v_pool, num_q)
                           for k_pool, v_pool in (pools[:2], [p.clone() for p in pools[:2]]))
    out = gemv.gemv(x, w, b, config=config, add_norm=norm, rope=rope)
    expected = gemv.reference(x, w, b, False, add_norm=norm, rope=expected_rope)
    if add_norm:
        (out, residual_out), (expected, expected_residual) = out, expected
        torch.testing.assert_close(residual_out, expected_residual)
    assert out.shape == (rows, num_q * head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.k_buffer, expected_rope.k_buffer, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.v_buffer, expected_rope.v_buffer, rtol=1e-4, atol=1e-4)
    others = [s for s in range(6) if s not in slot.tolist()]
    for written, before in zip((rope.k_buffer, rope.v_buffer), untouched):
        assert not torch.equal(written[slot], before[slot])
        torch.testing.assert_close(written[others], before[others], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("step", ["decode", "verify chain", "verify tree"])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_few_row_decoder_path_matches_the_batched_path(arch, step, tensor_cores, monkeypatch):
    """DecoderLayer's few-row path (the pre-norms inside the GEMVs, RoPE + KV write in the
    qkv GEMV; Qwen3's q/k norms keep the separate RoPE) gives the batched path's logits for
    a decode step (one row) or a draft chain or tree verified after a prefill (a row per
    node, each at its own position and slot), and leaves the same K/V in the pool."""
    from specserve.model import layers, llama
    from specserve.runner import model_runner
    from tests.model_fixtures import RunnerDriver, tiny_hf_model
    monkeypatch.setattr(model_runner, "use_cpu_linears", lambda model: None)  # GPU weight layout: row-major
    hf = tiny_hf_model(arch)
    drivers = [RunnerDriver.from_hf(hf) for _ in range(2)]
    for driver in drivers:
        driver.prefill([5, 17, 3, 9, 44, 2])
    tokens, parents = {"decode": ([11], [-1]), "verify chain": ([11, 3, 7, 9], [-1, 0, 1, 2]),
                       "verify tree": ([11, 3, 7, 9, 20], [-1, 0, 0, 1, 1])}[step]

    def run(driver):
        return driver.verify_tree(tokens, parents, commit_path=list(range(len(tokens))))

    expected = run(drivers[0])
    for module in (layers, llama):
        monkeypatch.setattr(module, "takes_few_row_kernels", lambda x: x.shape[0] <= gemv.MAX_ROWS)
    few_rows = gemv.FEW_ROW_CANDIDATES[3 if tensor_cores else 0]
    monkeypatch.setattr(gemv, "best_config", lambda *args: gemv.CANDIDATES[0] if args[-1] == 1 else few_rows)
    got = run(drivers[1])
    assert got.shape == expected.shape == (len(tokens), hf.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for pools in zip(drivers[0].runner.pool.k_buffers + drivers[0].runner.pool.v_buffers,
                     drivers[1].runner.pool.k_buffers + drivers[1].runner.pool.v_buffers):
        torch.testing.assert_close(*pools, rtol=1e-5, atol=1e-5)
