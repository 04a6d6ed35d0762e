"""The multi-row GEMV (gemv_rows.py) equals the unfused torch computation for 1..16 rows,
every epilogue and both inner products (tensor-core dot, fp32 FMA): Triton's interpreter
on the CPU in fp32; real sizes on a GPU with TRITON_INTERPRET=0."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch

from specserve.model import gemv, gemv_dispatch, gemv_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS = (1, 2, 7, 8, 16)
# per row count: its row block's first FMA config, then rows-as-M and weight-as-M dots, each
# whole and split over K (4 and 8 ways: some splits get no columns at these sizes)
DOTS = (("dot", 16, 256, 1, 4, 4), ("wdot", 64, 128, 1, 4, 4), ("dot", 16, 256, 4, 4, 4), ("wdot", 64, 128, 8, 4, 6))
CONFIGS = {rows: (gemv_rows.configs_for(rows)[0],) + DOTS for rows in ROWS}


def close(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    workspace, counters = gemv_rows.split_k_workspace(got.device)
    assert not workspace.any() and not counters.any(), "split-K left partial sums behind for the next call"


def each_config():
    return [(rows, config) for rows in ROWS for config in CONFIGS[rows]]


@pytest.mark.parametrize("rows,config", each_config())
@pytest.mark.parametrize("n,k", [(37, 300), (6, 40)])
def test_rows_match_linear(rows, config, n, k):
    torch.manual_seed(rows * 100 + n + k)
    x, w, bias = torch.randn(rows, k, device=DEVICE), torch.randn(n, k, device=DEVICE), torch.randn(n, device=DEVICE)
    for b in (None, bias):
        close(gemv_rows.gemm_rows(x, w, b, config=config), gemv.reference(x, w, b, False))


@pytest.mark.parametrize("rows,config", each_config())
def test_rows_add_norm_silu_mul_match_unfused(rows, config):
    """Each row's own norm scale (rows of very different sizes); residual + x written out."""
    torch.manual_seed(rows)
    k, n = 200, 2 * 45
    x = torch.randn(rows, k, device=DEVICE) * torch.logspace(-1, 1, rows, device=DEVICE)[:, None]
    residual = torch.randn(rows, k, device=DEVICE)
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w = torch.randn(n, k, device=DEVICE)
    out, residual_out = gemv_rows.gemm_rows(x, w, None, True, config, add_norm=norm)
    expected, expected_residual = gemv.reference(x, w, None, True, add_norm=norm)
    assert out.shape == (rows, 45)
    close(out, expected)
    torch.testing.assert_close(residual_out, expected_residual)
    torch.testing.assert_close(residual, norm.residual)  # the input residual is left alone


@pytest.mark.parametrize("rows,config", each_config())
def test_rows_gather_input_rows_for_the_lm_head(rows, config):
    """input_rows: only the rows that get logits, in their order (the final norm inside)."""
    torch.manual_seed(rows + 50)
    k, n, total = 64, 30, 16
    x, residual = torch.randn(total, k, device=DEVICE), torch.randn(total, k, device=DEVICE)
    norm = gemv.AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    picked = torch.randperm(total, device=DEVICE)[:rows]
    w = torch.randn(n, k, device=DEVICE)
    out, _ = gemv_rows.gemm_rows(x, w, config=config, add_norm=norm, input_rows=picked)
    expected, _ = gemv.reference(x[picked], w, None, False,
                                 add_norm=gemv.AddNorm(residual[picked], norm.weight, norm.eps))
    close(out, expected)


@pytest.mark.parametrize("rows,config", each_config())
@pytest.mark.parametrize("add_norm", [False, True])
def test_rows_rope_store_matches_linear_then_rope_and_store(rows, config, add_norm):
    """The qkv epilogue with a position and a KV slot per row (a draft tree: positions repeat
    across branches, slots do not); q rotated and returned, k and v in their slots, grouped
    query (3 q heads per kv head), every other slot untouched."""
    from specserve.model.rope import RotaryEmbedding
    torch.manual_seed(rows + 5)
    num_q, num_kv, head_dim, k = 3, 1, 16, 48
    x = torch.randn(rows, k, device=DEVICE)
    w, b = torch.randn((num_q + 2 * num_kv) * head_dim, k, device=DEVICE), torch.randn(80, device=DEVICE)
    norm = gemv.AddNorm(torch.randn(rows, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    tables = RotaryEmbedding(head_dim, 40, 10000.0, None).to(DEVICE)
    pool_slots = 24
    pools = [torch.randn(pool_slots, num_kv, head_dim, device=DEVICE) for _ in range(2)]
    untouched = [p.clone() for p in pools]
    positions = (torch.arange(rows, device=DEVICE) + 1) // 2 + 20   # depths of a two-wide tree after 20 tokens
    slots = torch.randperm(pool_slots, device=DEVICE)[:rows]
    rope, expected_rope = (gemv.RopeStore(tables.cos, tables.sin, positions, slots, k_pool, v_pool, num_q)
                           for k_pool, v_pool in (pools, [p.clone() for p in pools]))
    out = gemv_rows.gemm_rows(x, w, b, config=config, add_norm=norm, rope=rope)
    expected = gemv.reference(x, w, b, False, add_norm=norm, rope=expected_rope)
    if add_norm:
        (out, residual_out), (expected, expected_residual) = out, expected
        torch.testing.assert_close(residual_out, expected_residual)
    assert out.shape == (rows, num_q * head_dim)
    close(out, expected)
    close(rope.k_buffer, expected_rope.k_buffer)
    close(rope.v_buffer, expected_rope.v_buffer)
    others = [s for s in range(pool_slots) if s not in slots.tolist()]
    for written, before in zip((rope.k_buffer, rope.v_buffer), untouched):
        assert not torch.equal(written[slots], before[slots])
        torch.testing.assert_close(written[others], before[others], rtol=0, atol=0)


def test_row_blocks_and_limits():
    assert [gemv_rows.row_block(rows) for rows in (1, 2, 3, 5, 8, 9, 16)] == [2, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="rows=17"):
        gemv_rows.row_block(17)
    assert gemv_dispatch.takes_rows(1) and gemv_dispatch.takes_rows(16) and not gemv_dispatch.takes_rows(17)


def force_gemv_path(monkeypatch, rows_config) -> None:
    """The GPU dispatch on the CPU: up to 16 rows through the GEMV kernels (one row through
    gemv.py's), each with a fixed config instead of the GPU-timed choice."""
    from specserve.model import layers, llama
    for module in (layers, llama):
        monkeypatch.setattr(module, "takes_gemv_kernels", lambda x: x.shape[0] <= gemv_rows.MAX_ROWS)
    monkeypatch.setattr(gemv_dispatch, "one_row_config", lambda *args: gemv.CANDIDATES[0])
    monkeypatch.setattr(gemv_dispatch, "best_config", lambda *args: rows_config)


# node i's parent; depths 0, 1, 1, 2, 2, 2, 3: positions repeat across branches
TREE_7 = [-1, 0, 0, 1, 1, 2, 5]
CHAIN_16 = list(range(-1, 15))


DOT, FMA, WDOT_SPLIT = DOTS[0], gemv_rows.FMA_CANDIDATES[8][1], DOTS[3]


@pytest.mark.parametrize("arch,rows_config", [("qwen2", WDOT_SPLIT), ("llama", FMA), ("llama3-rope-tied", DOT),
                                              ("qwen3", WDOT_SPLIT)],
                         ids=["qwen2-wdot-split", "llama-fma", "llama3-dot", "qwen3-wdot-split"])
def test_verify_steps_through_the_rows_path_match_the_reference_path(arch, rows_config, monkeypatch):
    """A prefill (6 rows), a 7-node draft tree, a one-row decode and a 16-node chain through
    DecoderLM with the GEMV kernels forced give the batched torch path's logits and leave
    the same K/V in the pool: every row's RoPE and KV write at its node's depth and slot
    (Qwen3's q/k norms keep the separate RoPE; a tied lm_head reads the embedding)."""
    from specserve.runner import model_runner
    from tests.model_fixtures import RunnerDriver, tiny_hf_model
    monkeypatch.setattr(model_runner, "use_cpu_linears", lambda model: None)  # GPU weight layout: row-major
    hf = tiny_hf_model(arch)
    reference, fused = (RunnerDriver.from_hf(hf) for _ in range(2))

    def run(driver):
        logits = [driver.prefill([5, 17, 3, 9, 44, 2]).unsqueeze(0)]
        logits.append(driver.verify_tree([11, 30, 31, 40, 41, 42, 50], TREE_7, commit_path=[0, 2, 5, 6]))
        logits.append(driver.decode(12).unsqueeze(0))
        logits.append(driver.verify_tree(list(range(60, 76)), CHAIN_16, commit_path=list(range(9))))
        return logits

    expected = run(reference)
    force_gemv_path(monkeypatch, rows_config)
    got = run(fused)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
    for pools in zip(reference.runner.pool.k_buffers + reference.runner.pool.v_buffers,
                     fused.runner.pool.k_buffers + fused.runner.pool.v_buffers):
        torch.testing.assert_close(*pools, rtol=1e-5, atol=1e-5)


def test_tuning_drops_a_config_whose_output_disagrees():
    """gemv_tuning.agrees: rounding passes; a wrong lane, a missing split, a NaN or a wrong
    shape does not (such a config is never timed, so never chosen)."""
    from specserve.model.gemv_tuning import agrees
    torch.manual_seed(9)
    expected = torch.randn(8, 64)
    assert agrees(expected.to(torch.bfloat16).float(), expected)
    assert agrees((expected * 1.001, expected[:1]), (expected, expected))  # only the first output counts
    wrong_lane, nan = expected.clone(), expected.clone()
    wrong_lane[3, 5] += 1.0
    nan[0, 0] = float("nan")
    assert not agrees(wrong_lane, expected)
    assert not agrees(expected * 0.75, expected)
    assert not agrees(nan, expected)
    assert not agrees(expected[:7], expected)
