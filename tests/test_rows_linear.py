"""The few-row linear kernel equals F.linear and the unfused SiLU * up, pre-norm and RoPE +
KV write, for row counts 2-MAX_ROWS and tile configs with and without split K (Triton's
interpreter on the CPU, fp32; real sizes on a GPU)."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest
import torch
import triton

from specserve.model import gemv, rows_linear
from specserve.model.gemv import AddNorm, RopeStore

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIGS = [(16, 64, 1, 4, 2), (32, 32, 3, 4, 2), (16, 128, 4, 4, 2)]


def close(got, expected):
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("rows,n,k", [(2, 37, 300), (5, 64, 256), (16, 6, 130), (30, 20, 96)])
def test_rows_gemm_matches_linear(config, rows, n, k):
    torch.manual_seed(rows + n + k)
    x, w, bias = (torch.randn(rows, k, device=DEVICE), torch.randn(n, k, device=DEVICE),
                  torch.randn(n, device=DEVICE))
    for b in (None, bias):
        close(rows_linear.rows_gemm(x, w, b, config=config), gemv.reference(x, w, b, False))


@pytest.mark.parametrize("config", CONFIGS)
def test_split_workspace_is_left_clear_for_the_next_call(config):
    """The last slice of a lane block zeroes the workspace: a second call (other rows, other
    weights of the same shape) is as exact as the first."""
    torch.manual_seed(1)
    w = [torch.randn(40, 200, device=DEVICE) for _ in range(2)]
    for rows, weight in zip((3, 9), w):
        x = torch.randn(rows, 200, device=DEVICE)
        close(rows_linear.rows_gemm(x, weight, config=config), gemv.reference(x, weight, None, False))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("silu_mul,bias", [(False, True), (True, False)])
@pytest.mark.parametrize("prenormed", [False, True])
def test_rows_with_add_norm_match_add_rmsnorm_then_linear(config, silu_mul, bias, prenormed):
    """The pre-norm inside the kernel's loop or by its own kernel first (prenormed): residual
    + x written out, rmsnorm(residual + x) * w as input, each row normalised by its own sum
    of squares."""
    torch.manual_seed(4)
    rows, k, n = 6, 300, 2 * 37
    x, residual = torch.randn(rows, k, device=DEVICE), torch.randn(rows, k, device=DEVICE) * 3
    norm = AddNorm(residual, torch.randn(k, device=DEVICE), 1e-6)
    w, b = torch.randn(n, k, device=DEVICE), (torch.randn(n, device=DEVICE) if bias else None)
    out, residual_out = rows_linear.rows_gemm(x, w, b, silu_mul, config, add_norm=norm, prenormed=prenormed)
    expected, expected_residual = gemv.reference(x, w, b, silu_mul, add_norm=norm)
    torch.testing.assert_close(residual_out, expected_residual)
    close(out, expected)
    assert out.shape == (rows, n // 2 if silu_mul else n)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("add_norm,prenormed", [(False, False), (True, False), (True, True)])
def test_rows_with_rope_match_linear_then_rope_and_store(config, add_norm, prenormed):
    """The qkv epilogue per row: q rotated at the row's position and returned, k rotated and
    v copied into the row's pool slot (3 q heads share 1 kv head); other slots untouched."""
    from specserve.model.rope import RotaryEmbedding
    torch.manual_seed(5)
    rows, num_q, num_kv, head_dim, k = 3, 3, 1, 16, 48
    x = torch.randn(rows, k, device=DEVICE)
    w, b = torch.randn((num_q + 2 * num_kv) * head_dim, k, device=DEVICE), torch.randn(80, device=DEVICE)
    norm = AddNorm(torch.randn(rows, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    tables = RotaryEmbedding(head_dim, 12, 10000.0, None).to(DEVICE)
    pools = [torch.randn(8, num_kv, head_dim, device=DEVICE) for _ in range(2)]
    untouched = [p.clone() for p in pools]
    positions, slots = torch.tensor([7, 8, 11], device=DEVICE), torch.tensor([4, 1, 6], device=DEVICE)
    rope, expected_rope = (RopeStore(tables.cos, tables.sin, positions, slots, k_pool, v_pool, num_q)
                           for k_pool, v_pool in (pools, [p.clone() for p in pools]))
    out = rows_linear.rows_gemm(x, w, b, config=config, add_norm=norm, rope=rope, prenormed=prenormed)
    expected = gemv.reference(x, w, b, False, add_norm=norm, rope=expected_rope)
    if add_norm:
        (out, residual_out), (expected, expected_residual) = out, expected
        torch.testing.assert_close(residual_out, expected_residual)
    assert out.shape == (rows, num_q * head_dim)
    close(out, expected)
    close(rope.k_buffer, expected_rope.k_buffer)
    close(rope.v_buffer, expected_rope.v_buffer)
    for written, before in zip((rope.k_buffer, rope.v_buffer), untouched):
        assert not torch.equal(written[[4, 1, 6]], before[[4, 1, 6]])
        torch.testing.assert_close(written[[0, 2, 3, 5, 7]], before[[0, 2, 3, 5, 7]], rtol=0, atol=0)


@pytest.mark.parametrize("arch,prenormed", [("qwen2", False), ("qwen2", True), ("llama", True), ("qwen3", False)])
def test_decoder_row_kernels_match_the_batched_path(arch, prenormed, monkeypatch):
    """DecoderLayer's fused path for several rows (pre-norms inside the kernels, RoPE + KV
    write in the qkv kernel's epilogue; Qwen3's q/k norms keep the separate RoPE) gives the
    batched path's logits for a prefill and a verify step, and leaves the same K/V in the pool."""
    from specserve.model import layers, llama
    from specserve.runner import model_runner
    from tests.model_fixtures import RunnerDriver, tiny_hf_model
    monkeypatch.setattr(model_runner, "use_cpu_linears", lambda model: None)  # GPU weight layout: row-major
    hf = tiny_hf_model(arch)
    drivers = [RunnerDriver.from_hf(hf) for _ in range(2)]

    def run(driver):
        prefill = driver.prefill([5, 17, 3, 9, 44, 2])
        return prefill, driver.verify_tree([11, 8, 30, 4], [-1, 0, 0, 1], [0, 1, 3])

    expected = run(drivers[0])
    for module in (layers, llama):
        monkeypatch.setattr(module, "takes_row_kernels", lambda x: x.shape[0] <= rows_linear.MAX_ROWS)
    monkeypatch.setattr(gemv, "best_config", lambda *args: gemv.CANDIDATES[0])
    monkeypatch.setattr(rows_linear, "best_config", lambda *args: (CONFIGS[2], prenormed))
    got = run(drivers[1])
    for g, e in zip(got, expected):
        close(g, e)
    for pools in zip(drivers[0].runner.pool.k_buffers + drivers[0].runner.pool.v_buffers,
                     drivers[1].runner.pool.k_buffers + drivers[1].runner.pool.v_buffers):
        torch.testing.assert_close(*pools, rtol=1e-5, atol=1e-5)


# The 1.5B's matrices at their real K (1536, or 8960 for down_proj), N cut to a few lane
# blocks with a ragged tail: (N, K, silu_mul, add_norm, rope heads (q, kv, head_dim)).
# Under the interpreter (its time grows with K) down_proj's K is 5376, which slices alike for
# every candidate (down_k_slices_like_the_real_one checks it): the same slices equal or the
# last one shorter, at least 3 whole K blocks in each, no partial block; 8960 on a GPU.
DOWN_K = 8960 if DEVICE == "cuda" else 5376
REAL_K = {"qkv": ((4 + 2) * 128, 1536, False, True, (4, 1, 128)), "o_proj": (200, 1536, False, False, None),
          "gate_up": (400, 1536, True, True, None), "down": (200, DOWN_K, False, False, None)}
REPEATS = 20 if DEVICE == "cuda" else 1


def k_slices(k: int, config: tuple[int, int, int, int, int]) -> tuple:
    """How _rows_kernel cuts K for a config: per slice, "full", or "short" (fewer blocks than
    the first; at least 3 or how many), with min(blocks in a full slice, 3) and whether K ends
    on a block boundary."""
    block_k, split = min(config[1], max(16, triton.next_power_of_2(k))), config[2]
    slice_len = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    blocks = [triton.cdiv(max(0, min(k, (i + 1) * slice_len) - i * slice_len), block_k) for i in range(split)]
    return (min(blocks[0], 3), k % block_k == 0,
            tuple("full" if b == blocks[0] else "short" if b >= 3 else f"short {b}" for b in blocks))


def test_down_k_slices_like_the_real_one():
    configs = set(rows_linear.candidates_for(200, 16)) | set(rows_linear.candidates_for(200, 32))
    assert [k_slices(DOWN_K, c) for c in sorted(configs)] == [k_slices(8960, c) for c in sorted(configs)]
    assert any("short" in k_slices(DOWN_K, c)[2] for c in configs)


@pytest.mark.parametrize("rows", [3, 17])
@pytest.mark.parametrize("matrix", list(REAL_K))
def test_every_tuned_config_at_real_k_matches_the_unfused_path(matrix, rows):
    """Every config the tuner may pick (candidates_for: lanes 32-128, K split 1-16 ways), at
    the K slices the real shapes give, against F.linear and the separate norm/SiLU/RoPE."""
    from specserve.model.rope import RotaryEmbedding
    n, k, silu_mul, add_norm, heads = REAL_K[matrix]
    torch.manual_seed(rows + n + k)
    x, w, b = torch.randn(rows, k, device=DEVICE), torch.randn(n, k, device=DEVICE) / k ** 0.5, None
    norm = AddNorm(torch.randn(rows, k, device=DEVICE), torch.randn(k, device=DEVICE), 1e-6) if add_norm else None
    if heads:
        b = torch.randn(n, device=DEVICE)
        tables = RotaryEmbedding(heads[2], 4096, 1e6, None).to(DEVICE)
        positions, slots = torch.randint(0, 4096, (rows,), device=DEVICE), torch.randperm(64, device=DEVICE)[:rows]
        pools = [torch.randn(64, heads[1], heads[2], device=DEVICE) for _ in range(2)]
    lanes = n // 2 if silu_mul or heads else n
    configs = rows_linear.candidates_for(lanes, rows_linear.padded_rows(rows))
    assert any(c[2] > 1 for c in configs) and any(c[2] == 1 for c in configs)
    # prenormed inputs with one config of each epilogue path (split K or not): the loop is the bare one
    variants = [(c, False) for c in configs] + ([(next(c for c in configs if c[2] == s), True) for s in
                                                 (1, max(c[2] for c in configs))] if add_norm else [])
    for config, prenormed in variants:
        for _ in range(REPEATS):  # on a GPU, a race between threads or programs shows in some of them
            rope, expected_rope = ((RopeStore(tables.cos, tables.sin, positions, slots, kp.clone(), vp.clone(),
                                              heads[0]) for kp, vp in (pools, pools)) if heads else (None, None))
            got = rows_linear.rows_gemm(x, w, b, silu_mul, config, add_norm=norm, rope=rope, prenormed=prenormed)
            expected = gemv.reference(x, w, b, silu_mul, add_norm=norm, rope=expected_rope)
            if add_norm:
                torch.testing.assert_close(got[1], expected[1])
                got, expected = got[0], expected[0]
            close(got, expected)
            if heads:
                close(rope.k_buffer, expected_rope.k_buffer)
                close(rope.v_buffer, expected_rope.v_buffer)
