"""Ragged VERIFY batches (`ForwardBatch.ragged`): each request has its own number of draft
nodes (1..n), and the tokens past them are padding of no request. TritonBackend against
TorchNativeBackend, eager (decode rows, tree groups and the extend kernel) and through the static
buffers CUDA graphs use; padding tokens must come out zero, whatever stale memory (NaN)
the buffers and slot 0 hold.

Same setup as tests/test_triton_attention.py: Triton's interpreter on a CPU, small sizes,
split heuristics turned down so several splits and their merges run.
"""
from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined; 0 on a GPU

import pytest  # noqa: E402
import torch  # noqa: E402

from specserve.attention.base import ForwardBatch, ForwardMode  # noqa: E402
from specserve.attention.kernels.decode import row_owners  # noqa: E402
from specserve.attention.torch_native import TorchNativeBackend  # noqa: E402
from specserve.attention.triton_backend import TritonBackend  # noqa: E402
from specserve.kv.pool import PADDING_SLOT, KVPool  # noqa: E402
from tests.test_triton_attention import (DEVICE, make_batch, make_pool, random_qkv, random_tree_masks,  # noqa: E402
                                         route, small_splits)

HEADS = (6, 2, 64)
N = 6   # tree size of the masks (a graph's n): requests have 1..N nodes


def tree_masks(sizes: list[int], n: int = N, seed: int = 2) -> torch.Tensor:
    """(bs, n, n) random ancestor masks of trees of `sizes` nodes; rows past a tree are False."""
    masks = torch.zeros((len(sizes), n, n), dtype=torch.bool, device=DEVICE)
    masks[:, :max(sizes), :max(sizes)] = random_tree_masks(sizes, seed)
    return masks


def with_padding(batch: ForwardBatch, pad_tokens: int) -> ForwardBatch:
    """`batch` as a ragged VERIFY batch with pad_tokens tokens of no request after its own."""
    long = dict(dtype=torch.long, device=DEVICE)
    pad = lambda t, value: torch.cat([t, torch.full((pad_tokens,), value, **long)])  # noqa: E731
    return dataclasses.replace(batch, input_ids=pad(batch.input_ids, 0), positions=pad(batch.positions, 0),
                               out_slots=pad(batch.out_slots, PADDING_SLOT),
                               logits_indices=torch.arange(batch.num_tokens + pad_tokens, device=DEVICE),
                               ragged=True, attn_metadata=None)


def ragged_batch(pool: KVPool, prefix_lens: list[int], sizes: list[int], pad_tokens: int,
                 seed: int = 0) -> ForwardBatch:
    real = make_batch(pool, ForwardMode.VERIFY, prefix_lens, sizes, tree_masks(sizes, seed=seed + 2), seed)
    return with_padding(real, pad_tokens)


def reference(batch: ForwardBatch, q, k, v) -> torch.Tensor:
    """TorchNative's output (it also stores every token's K/V, padding's into slot 0)."""
    backend = TorchNativeBackend(*HEADS)
    backend.plan(batch)
    return backend.forward(q, k, v, 0, batch)


def poison_slot_zero(pool: KVPool) -> None:
    """Padding tokens write their K/V to slot 0, and rows load it masked: NaN there must reach no output."""
    pool.k_buffers[0][PADDING_SLOT] = float("nan")
    pool.v_buffers[0][PADDING_SLOT] = float("nan")


def check(got: torch.Tensor, expected: torch.Tensor, batch: ForwardBatch) -> None:
    real = sum(batch.extend_lens_host)
    torch.testing.assert_close(got[:real], expected[:real], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[real:], torch.zeros_like(got[real:])), "padding tokens must come out zero"


def run_eager(batch: ForwardBatch, target_programs: int, path: str) -> TritonBackend:
    """Triton on a ragged batch through `path` (test_triton_attention.route), against
    TorchNative, with slot 0 poisoned (K/V stored beforehand)."""
    q, k, v = random_qkv(batch.num_tokens, *HEADS)
    expected = reference(batch, q, k, v)
    poison_slot_zero(batch.kv_pool)
    backend = route(small_splits(TritonBackend(*HEADS), target_programs), path)
    backend.plan(batch)
    check(backend.forward(q, None, None, 0, batch), expected, batch)
    return backend


def test_row_owners_mark_padding():
    qo_indptr = torch.tensor([0, 5, 6, 9], dtype=torch.int32, device=DEVICE)
    assert row_owners(qo_indptr, 12).tolist() == [0] * 5 + [1] + [2] * 3 + [-1] * 3
    assert row_owners(qo_indptr, 9).dtype == torch.int32


@pytest.mark.parametrize("pad_tokens", [0, 4])
@pytest.mark.parametrize("target_programs", [1, 96])   # one split; several, merged by the last split
def test_eager_ragged_trees_as_decode_rows(pad_tokens, target_programs):
    pool = make_pool(HEADS[1], HEADS[2])
    batch = ragged_batch(pool, [100, 0, 260, 7], [5, 1, 6, 1], pad_tokens)
    run_eager(batch, target_programs, "rows")
    meta = batch.attn_metadata
    assert meta.tree_rows and (meta.partial_out is not None) == (target_programs > 1)
    assert meta.row_owner.tolist() == [0] * 5 + [1] + [2] * 6 + [3] + [-1] * pad_tokens
    assert meta.split_counters is None or not meta.split_counters.any()


@pytest.mark.parametrize("pad_tokens", [0, 5])
@pytest.mark.parametrize("target_programs", [1, 24])
def test_eager_ragged_trees_through_the_extend_kernel(pad_tokens, target_programs):
    pool = make_pool(HEADS[1], HEADS[2])
    batch = ragged_batch(pool, [30, 200, 0], [1, 6, 4], pad_tokens)
    run_eager(batch, target_programs, "extend")
    meta = batch.attn_metadata
    assert not meta.tree_rows and not meta.tree_groups and meta.zero_out == (pad_tokens > 0)
    assert (meta.partial_out is not None) == (target_programs > 1)


@pytest.mark.parametrize("pad_tokens", [0, 5])
@pytest.mark.parametrize("target_programs", [1, 96])
def test_eager_ragged_trees_as_tree_groups(pad_tokens, target_programs):
    """A request's 1..N nodes in one program; the padding tokens, which no program writes, come out zero."""
    pool = make_pool(HEADS[1], HEADS[2])
    batch = ragged_batch(pool, [30, 200, 0, 129], [1, 6, 4, 3], pad_tokens)
    run_eager(batch, target_programs, "groups")
    meta = batch.attn_metadata
    assert meta.tree_groups and not meta.tree_rows and meta.zero_out == (pad_tokens > 0)
    assert (meta.partial_out is not None) == (target_programs > 1)
    assert meta.split_counters is None or not meta.split_counters.any()


def test_uniform_trees_marked_ragged_match_the_unmarked_batch():
    """n nodes every request and no padding: the ragged plan is the uniform one."""
    pool = make_pool(HEADS[1], HEADS[2])
    batch = ragged_batch(pool, [40, 3], [N, N], 0)
    q, k, v = random_qkv(batch.num_tokens, *HEADS)
    outputs = []
    for ragged in (False, True):
        b = dataclasses.replace(batch, ragged=ragged)
        backend = small_splits(TritonBackend(*HEADS))
        backend.plan(b)
        assert b.attn_metadata.tree_rows
        outputs.append(backend.forward(q, k, v, 0, b))
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)


@pytest.mark.parametrize("groups", [1, 2])   # one padded layout, or a layout per group of requests
def test_torch_native_gives_padding_zeros(groups):
    pool = make_pool(HEADS[1], HEADS[2])
    sizes = [3, 1, 5] if groups == 2 else [3, 2, 5]   # single tokens are a group of their own
    real = make_batch(pool, ForwardMode.VERIFY, [20, 9, 50], sizes, tree_masks(sizes))
    padded = with_padding(real, 3)
    q, k, v = random_qkv(padded.num_tokens, *HEADS)
    expected = reference(real, q[:real.num_tokens], k[:real.num_tokens], v[:real.num_tokens])
    got = reference(padded, q, k, v)
    assert len(padded.attn_metadata) == groups
    check(got, expected, padded)


def placeholder_batch(pool: KVPool, bs: int, num_tokens: int) -> ForwardBatch:
    """What a ragged graph is captured with: bs one-node requests on row 0, the rest padding."""
    long = dict(dtype=torch.long, device=DEVICE)
    mask = torch.zeros((bs, N, N), dtype=torch.bool, device=DEVICE)
    mask[:, 0, 0] = True
    return ForwardBatch(
        mode=ForwardMode.VERIFY, input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(num_tokens, **long),
        out_slots=torch.full((num_tokens,), PADDING_SLOT, **long), req_rows=torch.zeros(bs, **long),
        prefix_lens=torch.zeros(bs, **long), extend_lens=torch.ones(bs, **long),
        prefix_lens_host=[0] * bs, extend_lens_host=[1] * bs, kv_pool=pool,
        logits_indices=torch.arange(num_tokens, device=DEVICE), tree_mask=mask, ragged=True)


def graph_view(batch: ForwardBatch) -> ForwardBatch:
    """The batch as a graph plans it: host lists hold nothing but the batch size."""
    return dataclasses.replace(batch, prefix_lens_host=[0] * batch.batch_size,
                               extend_lens_host=[0] * batch.batch_size, attn_metadata=None)


@pytest.mark.parametrize("path", ["rows", "groups", "extend"])
def test_static_ragged_plan_replays_new_lengths(path):
    """One graph state, a 4-request 16-token graph captured once, replayed with two batches
    of different node counts; the static scratch (partials, split counts) and slot 0 hold
    NaN or stale counts beforehand: none of it may reach an output."""
    heads_per_kv = HEADS[0] // HEADS[1]
    pool = make_pool(HEADS[1], HEADS[2])
    tree_rows = path == "rows"
    backend = route(small_splits(TritonBackend(*HEADS), target_programs=24 if path == "extend" else 160), path)
    backend.init_cuda_graph_state(max_bs=4, max_tokens_per_req=N, kv_pool=pool)
    num_tokens = 16
    captured_batch = placeholder_batch(pool, 4, num_tokens)
    backend.plan_for_capture(captured_batch)
    captured = captured_batch.attn_metadata
    assert captured.tree_rows == tree_rows and captured.partial_out is not None
    assert captured.tree_groups == (path == "groups")

    g = backend._graph
    for seed, (prefix_lens, sizes) in enumerate([([60, 3, 200, 0], [5, 1, 3, 2]), ([9, 300, 1, 40], [1, 6, 1, 1])]):
        batch = ragged_batch(pool, prefix_lens, sizes, num_tokens - sum(sizes), seed=seed)
        q, k, v = random_qkv(num_tokens, *HEADS, seed=seed + 1)
        expected = reference(batch, q, k, v)
        poison_slot_zero(pool)
        for buffer in (g.partial_out, g.partial_lse):
            buffer.fill_(float("nan"))
        g.split_counts.fill_(3)     # stale counts of an earlier replay
        g.row_owner.fill_(1)
        replay = graph_view(batch)
        backend.plan_for_replay(replay)
        meta = replay.attn_metadata
        # a captured graph re-reads the same memory: the replay plan hands out the same buffers and grid
        for name in ("req_rows", "prefix_lens", "qo_indptr", "tree_mask", "partial_out", "partial_lse",
                     "row_owner"):
            a, b = getattr(captured, name), getattr(meta, name)
            assert (a is None) == (b is None) and (a is None or a.data_ptr() == b.data_ptr()), name
        assert (meta.row_blocks, meta.tree_rows, meta.zero_out) == (captured.row_blocks, tree_rows, not tree_rows)
        assert meta.partial_out.shape[2] > 1
        if not tree_rows:   # partials for the requests' tokens only
            assert meta.partial_out.shape[0] == min(num_tokens, 4 * N)
        if path == "extend":
            assert meta.row_blocks == -(-N * heads_per_kv // 64)
        check(backend.forward(q, None, None, 0, replay), expected, batch)
        assert not g.split_counters.any()


def test_graph_state_fits_every_ragged_graph():
    """Any bs <= max_bs and num_tokens <= max_bs * max_tokens_per_req plans within the state."""
    pool = make_pool(HEADS[1], HEADS[2])
    backend = route(small_splits(TritonBackend(*HEADS), target_programs=160), "groups")
    backend.max_tree_rows = 10
    backend.init_cuda_graph_state(max_bs=3, max_tokens_per_req=4, kv_pool=pool)
    for bs in range(1, 4):
        for num_tokens in range(bs, 13):
            for n in range(1, 5):
                batch = dataclasses.replace(placeholder_batch(pool, bs, num_tokens), tree_mask=torch.eye(
                    n, dtype=torch.bool, device=DEVICE).repeat(bs, 1, 1))
                backend.plan_for_replay(batch)   # views past the buffers' ends would raise
                meta = batch.attn_metadata
                assert meta.tree_rows == (num_tokens <= 10) and meta.tree_groups == (num_tokens > 10)
                if meta.tree_rows:   # computed in the static buffer, not a reallocated one
                    assert meta.row_owner.data_ptr() == backend._graph.row_owner.data_ptr()
                    assert meta.row_owner.numel() == num_tokens
