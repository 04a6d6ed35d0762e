"""The few-row GEMV kernels equal F.linear (and the unfused norm, SiLU * up, RoPE + KV write)
for 1..16 rows and every tile config the engine may pick (Triton's interpreter on the CPU,
fp32; real sizes on a GPU), and the decoder's few-row path equals its batched path."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch

from specserve.model import gemv
from specserve.model.gemv_tuning import CANDIDATES, agrees

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fma_configs(bucket: int) -> list:
    return [config for config in CANDIDATES[bucket] if not config.dot]


def dot_configs(bucket: int) -> list:
    return [config for config in CANDIDATES[bucket] if config.dot]


# row counts from 1 to 16, each with one of its bucket's configs: FMA, and dot for 3 and 16 rows
ROW_CASES = [(1, CANDIDATES[1][0]), (2, fma_configs(2)[0]), (3, fma_configs(4)[1]), (3, dot_configs(4)[0]),
             (8, fma_configs(8)[2]), (16, fma_configs(16)[0]), (16, dot_configs(16)[1])]


def _ids(case) -> str:
    return f"{case[0]}rows-{case[1].label}"


@pytest.mark.parametrize("config", CANDIDATES[1])
@pytest.mark.parametrize("n,k", [(37, 300), (64, 256), (6, 2100)])
def test_one_row_gemv_matches_linear(config, n, k):
    torch.manual_seed(n + k)
    x, w, bias = torch.randn(1, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    for b in (None, bias):
        torch.testing.assert_close(gemv.gemv(x, w, b, False, config), gemv.reference(x, w, b, False),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", [(rows, config) for rows, bucket in ((2, 2), (3, 4), (8, 8), (16, 16))
                                  for config in CANDIDATES[bucket]], ids=_ids)
def test_few_rows_gemv_matches_linear(case):
    """Every config of every row bucket, at a row count of that bucket, with lanes and
    columns that do not fill the tiles."""
    rows, config = case
    torch.manual_seed(rows)
    n, k = 21, 300
    x, w, bias = torch.randn(rows, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    out = gemv.gemv(x, w, bias, False, config)
    assert out.shape == (rows, n)
    torch.testing.assert_close(out, gemv.reference(x, w, bias, False), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ROW_CASES, ids=_ids)
def test_gemv_silu_mul_matches_unfused(case):
    rows, config = case
    torch.manual_seed(3)
    x, w = torch.randn(rows, 200, device=DEVICE), torch.randn(2 * 45, 200, device=DEVICE)
    out = gemv.gemv(x, w, None, True, config)
    assert out.shape == (rows, 45)
    torch.testing.assert_close(out, gemv.reference(x, w, None, True), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ROW_CASES, ids=_ids)
@pytest.mark.parametrize("silu_mul,bias", [(False, True), (True, False)])
def test_gemv_with_add_norm_matches_add_rmsnorm_then_linear(case, silu_mul, bias):
    """The pre-norm inside the GEMV: residual + x written out for every row, each row
    normalised by its own rms (rows of very different scales)."""
    rows, config = case
    torch.manual_seed(4)
    k, n = 300, 2 * 37
    scales = torch.logspace(-1, 1, rows, device=DEVICE)[:, None]
    x, residual = torch.randn(rows, k, device=DEVICE) * scales, torch.randn(rows, k, device=DEVICE)
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w, b = torch.randn(n, k, device=DEVICE), (torch.randn(n, device=DEVICE) if bias else None)
    out, residual_out = gemv.gemv(x, w, b, silu_mul, config, add_norm=norm)
    expected, expected_residual = gemv.reference(x, w, b, silu_mul, add_norm=norm)
    torch.testing.assert_close(residual_out, expected_residual)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(residual, norm.residual)  # the input residual is left alone


@pytest.mark.parametrize("case", ROW_CASES, ids=_ids)
@pytest.mark.parametrize("add_norm", [False, True])
def test_gemv_with_rope_matches_linear_then_rope_and_store(case, add_norm):
    """The qkv epilogue: q rotated and returned, k rotated and v copied into each row's slot
    of the KV pool at each row's position (grouped-query: 3 q heads share 1 kv head); the
    other slots untouched."""
    from specserve.model.layers import RotaryEmbedding
    rows, config = case
    torch.manual_seed(5)
    num_q, num_kv, head_dim, k = 3, 1, 16, 48
    x = torch.randn(rows, k, device=DEVICE)
    w, b = torch.randn((num_q + 2 * num_kv) * head_dim, k, device=DEVICE), torch.randn(80, device=DEVICE)
    norm = gemv.AddNorm(torch.randn(rows, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    tables = RotaryEmbedding(head_dim, 40, 10000.0, None).to(DEVICE)
    pool_slots = rows + 3
    pools = [torch.randn(pool_slots, num_kv, head_dim, device=DEVICE) for _ in range(2)]
    untouched = [p.clone() for p in pools]
    positions = torch.randperm(40, device=DEVICE)[:rows]
    slots = torch.randperm(pool_slots, device=DEVICE)[:rows]
    rope, expected_rope = (gemv.RopeStore(tables.cos, tables.sin, positions, slots, k_pool, v_pool, num_q)
                           for k_pool, v_pool in (pools, [p.clone() for p in pools]))
    out = gemv.gemv(x, w, b, False, config, add_norm=norm, rope=rope)
    expected = gemv.reference(x, w, b, False, add_norm=norm, rope=expected_rope)
    if add_norm:
        (out, residual_out), (expected, expected_residual) = out, expected
        torch.testing.assert_close(residual_out, expected_residual)
    assert out.shape == (rows, num_q * head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.k_buffer, expected_rope.k_buffer, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rope.v_buffer, expected_rope.v_buffer, rtol=1e-4, atol=1e-4)
    others = [s for s in range(pool_slots) if s not in slots.tolist()]
    for written, before in zip((rope.k_buffer, rope.v_buffer), untouched):
        assert not torch.equal(written[slots], before[slots])
        torch.testing.assert_close(written[others], before[others], rtol=0, atol=0)


@pytest.mark.parametrize("config", [fma_configs(4)[0], dot_configs(4)[0]], ids=lambda c: c.label)
def test_gemv_input_rows_computes_only_those_rows(config):
    """The lm_head's gather: output row i is input row input_rows[i] (any order), the norm
    reading the same rows of the residual."""
    torch.manual_seed(6)
    k, n = 64, 29
    x, residual = torch.randn(7, k, device=DEVICE), torch.randn(7, k, device=DEVICE)
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w, picked = torch.randn(n, k, device=DEVICE), torch.tensor([6, 0, 3], device=DEVICE)
    out, _ = gemv.gemv(x, w, None, False, config, add_norm=norm, input_rows=picked)
    expected, _ = gemv.reference(x[picked], w, None, False, gemv.AddNorm(residual[picked], norm.weight, norm.eps))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tuned", ["gemv", "cublas"])
@pytest.mark.parametrize("picked", [[5], [4, 1]], ids=["one-row", "two-rows"])
def test_few_rows_linear_gathers_for_every_path(tuned, picked, monkeypatch):
    """few_rows_linear takes input_rows whichever path wins: the rows kernel's gather, or a
    torch gather before the one-row kernel or cuBLAS + the unfused kernels."""
    monkeypatch.setattr(gemv, "best_config", lambda *args: CANDIDATES[args[6]][0] if tuned == "gemv" else None)
    torch.manual_seed(7)
    k, n = 48, 21
    x, residual = torch.randn(6, k, device=DEVICE), torch.randn(6, k, device=DEVICE)
    norm, w = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6), torch.randn(n, k, device=DEVICE)
    rows = torch.tensor(picked, device=DEVICE)
    out, _ = gemv.few_rows_linear(x, w, add_norm=norm, input_rows=rows)
    expected, _ = gemv.reference(x[rows], w, None, False, gemv.AddNorm(residual[rows], norm.weight, norm.eps))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_row_bucket_pads_to_a_power_of_two_and_refuses_other_counts():
    assert [gemv.row_bucket(m) for m in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    for rows in (0, 17):
        with pytest.raises(ValueError, match="rows="):
            gemv.row_bucket(rows)


def test_few_rows_on_a_gpu_take_the_gemv_kernels(monkeypatch):
    """The dispatch rule: 1..FEW_ROWS rows of a 2-D CUDA input (or that many rows picked from
    a larger one, as the lm_head does), while gemv.ENABLED; CPU tensors never (no Triton)."""
    from types import SimpleNamespace
    from specserve.model.layers import takes_few_rows_kernels
    cuda_rows = lambda rows, dims=2: SimpleNamespace(is_cuda=True, shape=(rows, 64), dim=lambda: dims)
    assert [takes_few_rows_kernels(cuda_rows(m)) for m in (1, 8, 16, 17, 0)] == [True, True, True, False, False]
    assert takes_few_rows_kernels(cuda_rows(300), rows=4) and not takes_few_rows_kernels(cuda_rows(300), rows=20)
    assert not takes_few_rows_kernels(cuda_rows(2, dims=3))
    assert not takes_few_rows_kernels(torch.zeros(2, 64))
    monkeypatch.setattr(gemv, "FEW_ROWS", 1)  # the A/B setting: batch-1 steps only
    assert takes_few_rows_kernels(cuda_rows(1)) and not takes_few_rows_kernels(cuda_rows(2))
    monkeypatch.setattr(gemv, "ENABLED", False)
    assert not takes_few_rows_kernels(cuda_rows(1))


def test_tuning_leaves_out_a_config_with_wrong_results():
    reference = torch.tensor([[10.0, -20.0, 5.0]])
    assert agrees([reference + 0.1], [reference])
    assert not agrees([reference + torch.tensor([[0.0, 0.0, 1.0]])], [reference])
    assert not agrees([reference * float("nan")], [reference])
    assert not agrees([reference, torch.zeros(2)], [reference, torch.ones(2)])  # e.g. a KV write left out


@pytest.mark.parametrize("arch,kind", [("qwen2", "fma"), ("llama", "dot"), ("qwen3", "dot")])
def test_few_rows_decoder_path_matches_the_batched_path(arch, kind, monkeypatch):
    """DecoderLayer's few-row path (the pre-norms inside the GEMVs, RoPE + KV write in the
    qkv GEMV; Qwen3's q/k norms keep the separate RoPE) gives the batched path's logits and
    KV pool through a short prefill (6 rows, one logits row), a long one (20 rows: the
    batched layers, the lm_head's one logits row through the GEMV), a decode step (the
    one-row kernel), a 7-node tree (VERIFY, rows padded to 8: the tree mask is attention's)
    and a 16-node chain."""
    from specserve.model import layers, llama
    from specserve.runner import model_runner
    from tests.model_fixtures import RunnerDriver, tiny_hf_model
    monkeypatch.setattr(model_runner, "use_cpu_linears", lambda model: None)  # GPU weight layout: row-major
    hf = tiny_hf_model(arch)
    drivers = [RunnerDriver.from_hf(hf) for _ in range(2)]

    def steps(driver: RunnerDriver) -> list[torch.Tensor]:
        tree = ([11, 30, 31, 40, 41, 42, 50], [-1, 0, 0, 1, 1, 2, 3])
        return [driver.prefill([5, 17, 3, 9, 44, 2]), driver.prefill(list(range(20, 40))), driver.decode(11),
                driver.verify_tree(*tree, commit_path=[0, 1, 4]),
                driver.verify_tree(list(range(60, 76)), list(range(-1, 15)), commit_path=[0, 1, 2])]

    expected = steps(drivers[0])
    few_rows = lambda x, rows=None: x.dim() == 2 and 0 < (x.shape[0] if rows is None else rows) <= gemv.FEW_ROWS
    for module in (layers, llama):
        monkeypatch.setattr(module, "takes_few_rows_kernels", few_rows)
    # the widest FMA tiles: fewer programs for the interpreter to run
    configs = (lambda bucket: max(fma_configs(bucket), key=lambda c: c.block_n)) if kind == "fma" else \
        (lambda bucket: (dot_configs(bucket) or CANDIDATES[1])[0])
    monkeypatch.setattr(gemv, "best_config", lambda *args: configs(args[6]))
    for got, want in zip(steps(drivers[1]), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for pools in zip(drivers[0].runner.pool.k_buffers + drivers[0].runner.pool.v_buffers,
                     drivers[1].runner.pool.k_buffers + drivers[1].runner.pool.v_buffers):
        torch.testing.assert_close(*pools, rtol=1e-5, atol=1e-5)
