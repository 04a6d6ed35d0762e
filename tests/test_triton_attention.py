"""TritonBackend against TorchNativeBackend: DECODE, EXTEND (with and without a prefix),
VERIFY (random trees of different sizes, through the extend kernel, as decode rows and as tree
groups) and
the static-buffer path used by CUDA graphs.

The kernels run in Triton's interpreter on a CPU, which is slow: sizes stay small, and the
split heuristics are turned down so that several splits are still exercised. With
TRITON_INTERPRET=0 on a GPU machine the same tests run the compiled kernels on CUDA.
"""
from __future__ import annotations

import os

# must be set before triton is imported anywhere in this process
INTERPRET = os.environ.setdefault("TRITON_INTERPRET", "1") == "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401  -- no triton must fail these tests, never skip them

from specserve.attention.base import ForwardBatch, ForwardMode  # noqa: E402
from specserve.attention.kernels import decode as decode_kernels  # noqa: E402
from specserve.attention.kernels.extend import extend_attention, num_row_blocks  # noqa: E402
from specserve.attention.kernels.tree_groups import MAX_GROUP_ROWS  # noqa: E402
from specserve.attention.torch_native import TorchNativeBackend  # noqa: E402
from specserve.attention.triton_backend import TritonBackend  # noqa: E402
from specserve.kv.pool import PADDING_SLOT, KVPool  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
POOL_SIZE = 2048
MAX_CONTEXT = 512
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 3 and 4
HEADS = [(2, 2, 64), (6, 2, 64), (8, 2, 128)]


def test_kernels_run_where_the_tensors_are():
    # a module imported earlier without TRITON_INTERPRET would have compiled the kernels for a GPU
    assert (type(decode_kernels._decode_kernel).__name__ == "InterpretedFunction") == INTERPRET


def make_pool(num_kv_heads: int, head_dim: int, seed: int = 0) -> KVPool:
    pool = KVPool(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, size=POOL_SIZE, max_requests=8,
                  max_context=MAX_CONTEXT, dtype=torch.float32, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))  # prefix K/V: whatever the slots hold
    return pool


def make_batch(pool: KVPool, mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
               tree_mask: torch.Tensor | None = None, seed: int = 0) -> ForwardBatch:
    """Requests with shuffled (non-contiguous) prefix and new slots."""
    gen = torch.Generator().manual_seed(seed)
    rows = [pool.alloc_row() for _ in prefix_lens]
    slots = torch.tensor(pool.slots.alloc(sum(prefix_lens) + sum(extend_lens)))
    slots = slots[torch.randperm(slots.numel(), generator=gen)].to(DEVICE)
    start = 0
    for row, prefix in zip(rows, prefix_lens):
        pool.write_positions(row, 0, slots[start:start + prefix].to(torch.int32))
        start += prefix
    num_tokens = sum(extend_lens)
    return ForwardBatch(
        mode=mode, input_ids=torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
        positions=torch.zeros(num_tokens, dtype=torch.long, device=DEVICE), out_slots=slots[start:],
        req_rows=torch.tensor(rows, device=DEVICE), prefix_lens=torch.tensor(prefix_lens, device=DEVICE),
        extend_lens=torch.tensor(extend_lens, device=DEVICE), prefix_lens_host=list(prefix_lens),
        extend_lens_host=list(extend_lens), kv_pool=pool,
        logits_indices=torch.arange(num_tokens, device=DEVICE), tree_mask=tree_mask)


def random_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn((num_tokens, heads, head_dim), generator=gen).to(DEVICE)
                 for heads in (num_heads, num_kv_heads, num_kv_heads))


def random_tree_masks(sizes: list[int], seed: int = 2) -> torch.Tensor:
    """(bs, n, n) ancestor-or-self masks of random trees, n = max(sizes); padding is False."""
    gen = torch.Generator().manual_seed(seed)
    n = max(sizes)
    masks = torch.zeros((len(sizes), n, n), dtype=torch.bool)
    for b, size in enumerate(sizes):
        for i in range(size):
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=gen))
                masks[b, i] = masks[b, parent]
            masks[b, i, i] = True
    return masks.to(DEVICE)


def small_splits(backend: TritonBackend, target_programs: int = 24) -> TritonBackend:
    """Split keys at small sizes too, so the split path and the merge are exercised."""
    backend.min_keys_per_split = 64
    backend.target_programs = target_programs
    return backend


def attend(backend, batch: ForwardBatch, q, k, v) -> torch.Tensor:
    backend.plan(batch)
    return backend.forward(q, k, v, 0, batch)


def route(backend: TritonBackend, path: str) -> TritonBackend:
    """VERIFY through the decode kernel's rows ("rows"), tree_groups.py ("groups") or the extend kernel."""
    backend.max_tree_rows = 64 if path == "rows" else 0
    backend.max_group_rows = MAX_GROUP_ROWS if path == "groups" else 0
    return backend


def compare(heads, mode, prefix_lens, extend_lens, tree_mask=None, target_programs=24, max_tree_rows=None,
            path=None):
    num_heads, num_kv_heads, head_dim = heads
    pool = make_pool(num_kv_heads, head_dim)
    batch = make_batch(pool, mode, prefix_lens, extend_lens, tree_mask)
    q, k, v = random_qkv(batch.num_tokens, num_heads, num_kv_heads, head_dim)
    expected = attend(TorchNativeBackend(*heads), batch, q, k, v)
    triton_backend = small_splits(TritonBackend(*heads), target_programs)
    if max_tree_rows is not None:
        triton_backend.max_tree_rows = max_tree_rows
    if path is not None:
        route(triton_backend, path)
    got = attend(triton_backend, batch, q, k, v)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    return batch


@pytest.mark.parametrize("heads", HEADS + [(4, 2, 80)])
def test_decode(heads):
    # the longer contexts are merged from several splits, the shortest ones written by their one split
    batch = compare(heads, ForwardMode.DECODE, prefix_lens=[0, 7, 150, 300], extend_lens=[1, 1, 1, 1])
    assert batch.attn_metadata.partial_out is not None
    assert not batch.attn_metadata.split_counters.any()


def test_decode_merges_in_the_last_split_in_chunks_and_resets_its_counters(monkeypatch):
    """More non-empty splits than the merge reads at once (a chunked merge: 401 keys in
    128-key splits are 4 splits, read 2 at a time); the arrival counters are zero again
    after the launch (graph replays reuse them)."""
    monkeypatch.setattr(decode_kernels, "MERGE_CHUNK", 2)
    batch = compare((4, 2, 32), ForwardMode.DECODE, [400, 5], [1, 1], target_programs=64)
    meta = batch.attn_metadata
    assert meta.partial_out.shape[2] >= 4
    assert not meta.split_counters.any()


def test_decode_one_split_writes_output_directly():
    batch = compare((6, 2, 64), ForwardMode.DECODE, [3, 200], [1, 1], target_programs=1)
    assert batch.attn_metadata.partial_out is None


def split_counts(batch: ForwardBatch) -> list[int]:
    """How many key splits each new token's request used (the extend kernel writes it)."""
    return batch.attn_metadata.split_counts[:batch.num_tokens].tolist()


@pytest.mark.parametrize("heads", HEADS)
def test_extend_without_prefix(heads):
    batch = compare(heads, ForwardMode.EXTEND, prefix_lens=[0, 0, 0], extend_lens=[1, 23, 70], target_programs=200)
    # splits were planned, but a prompt's own tokens are too few keys per new token to split
    assert batch.attn_metadata.partial_out is not None and set(split_counts(batch)) == {1}


@pytest.mark.parametrize("heads", HEADS)
def test_chunked_extend(heads):
    # a prefill chunk after earlier chunks: the prefix comes from req_to_token
    compare(heads, ForwardMode.EXTEND, prefix_lens=[37, 130, 0], extend_lens=[16, 45, 5])


@pytest.mark.parametrize("prefix", [0, 37])
def test_one_prompt_is_attended_causally_without_a_mask_tensor(prefix):
    """torch_native attends one request's prompt or chunk causally aligned to the lower right
    with no mask tensor (last_queries_causal); it and the extend kernel agree."""
    from specserve.attention.torch_native import build_padded_layout
    batch = compare(HEADS[0], ForwardMode.EXTEND, prefix_lens=[prefix], extend_lens=[21])
    layout = build_padded_layout(batch)
    assert layout.causal and layout.mask is None


def test_prompts_alone_attend_as_padded_together(monkeypatch):
    """Each prompt or chunk its own group (torch_native on a GPU), decode rows shared: the
    same output as the CPU's padded groups."""
    from specserve.attention import torch_native
    heads = HEADS[0]
    pool = make_pool(heads[1], heads[2])
    batch = make_batch(pool, ForwardMode.EXTEND, prefix_lens=[37, 0, 12, 40], extend_lens=[16, 23, 1, 1])
    q, k, v = random_qkv(batch.num_tokens, *heads)
    expected = attend(TorchNativeBackend(*heads), batch, q, k, v)
    monkeypatch.setattr(torch_native, "prompts_alone", lambda batch: True)
    got = attend(TorchNativeBackend(*heads), batch, q, k, v)
    groups = batch.attn_metadata
    assert sorted(len(g.layout.kv_slots) for g in groups) == [1, 1, 2]
    assert sum(g.layout.causal for g in groups) == 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix", [0, 300])
def test_last_queries_causal_equals_a_lower_right_mask(prefix):
    """torch_native's one-prompt attention (flash attention on a GPU, in bf16) against the
    math backend with the mask written out: GQA, queries the last 70 of the keys' positions."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from specserve.attention.torch_native import last_queries_causal
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(prefix)
    q, k, v = (torch.randn((1, heads, length, 64), generator=gen).to(DEVICE, dtype)
               for heads, length in ((6, 70), (2, prefix + 70), (2, prefix + 70)))
    mask = torch.ones((70, prefix + 70), dtype=torch.bool, device=DEVICE).tril(prefix)
    with sdpa_kernel([SDPBackend.MATH]):
        expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                                    scale=0.125, enable_gqa=True)
    got = last_queries_causal(q, k, v, 0.125, True)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_extend_splits_only_a_long_prefix_against_few_new_tokens():
    """4 new tokens after 300 keys are split and merged; 45 after 130 are not (fewer than
    KEYS_PER_NEW_TOKEN keys each), nor a prompt of 5 with no prefix."""
    batch = compare((6, 2, 64), ForwardMode.EXTEND, prefix_lens=[300, 130, 0], extend_lens=[4, 45, 5])
    counts = split_counts(batch)
    assert min(counts[:4]) > 1 and set(counts[4:]) == {1}


@pytest.mark.parametrize("config", [dict(BLOCK_M=32, BLOCK_N=16, num_warps=2, num_stages=1),
                                    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)])
def test_extend_with_another_launch_configuration(config):
    """A configuration other than CONFIG (row blocks counted with its BLOCK_M) gives the same
    attention: the lab's sweeps time them, and a long prompt's chunk may take another."""
    heads = (8, 2, 128)
    batch = compare(heads, ForwardMode.EXTEND, prefix_lens=[37, 130, 0], extend_lens=[16, 45, 5])
    q, _, _ = random_qkv(batch.num_tokens, *heads)
    meta, pool = batch.attn_metadata, batch.kv_pool
    expected = TorchNativeBackend(*heads)
    expected.plan(batch)
    want = expected.forward(q, None, None, 0, batch)       # K/V as compare() stored them
    got = torch.empty_like(q)
    extend_attention(q, pool.k_buffers[0], pool.v_buffers[0], pool.req_to_token, meta.req_rows, meta.prefix_lens,
                     meta.qo_indptr, batch.out_slots, got, TritonBackend(*heads).scale,
                     num_row_blocks(45, 4, config["BLOCK_M"]), config=config)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_extend_one_split_writes_output_directly():
    batch = compare((6, 2, 64), ForwardMode.EXTEND, [0, 90], [30, 12], target_programs=1)
    assert batch.attn_metadata.partial_out is None


@pytest.mark.parametrize("heads", HEADS)
def test_verify_random_trees(heads):
    sizes = [8, 1, 5]  # different tree sizes, padded to 8 in the mask
    batch = compare(heads, ForwardMode.VERIFY, prefix_lens=[100, 3, 260], extend_lens=sizes,
                    tree_mask=random_tree_masks(sizes))
    assert not batch.attn_metadata.tree_rows   # ragged: the extend kernel


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("target_programs", [1, 96])
def test_verify_trees_as_decode_rows(heads, target_programs):
    """n nodes for every request (a tier's trees; a node past a request's tree sees only
    itself): each node is a decode row over its request's prefix and the new keys its mask
    row allows, in one split or merged from several by the last split."""
    masks = random_tree_masks([6, 1, 4], seed=5)
    masks[1:, torch.arange(6), torch.arange(6)] = True
    batch = compare(heads, ForwardMode.VERIFY, prefix_lens=[100, 0, 260], extend_lens=[6, 6, 6], tree_mask=masks,
                    target_programs=target_programs)
    meta = batch.attn_metadata
    assert meta.tree_rows and (meta.partial_out is not None) == (target_programs > 1)
    assert meta.split_counters is None or not meta.split_counters.any()


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("target_programs", [1, 96])
def test_verify_trees_as_tree_groups(heads, target_programs):
    """A program per request and kv head holds all its nodes' query rows (a node past a
    request's tree sees only itself): one split, or several merged by the last split, which
    leaves its arrival counters zero."""
    masks = random_tree_masks([6, 1, 4], seed=5)
    masks[1:, torch.arange(6), torch.arange(6)] = True
    batch = compare(heads, ForwardMode.VERIFY, prefix_lens=[100, 0, 260], extend_lens=[6, 6, 6], tree_mask=masks,
                    target_programs=target_programs, path="groups")
    meta = batch.attn_metadata
    assert meta.tree_groups and not meta.tree_rows
    assert (meta.partial_out is not None) == (target_programs > 1)
    assert meta.split_counters is None or not meta.split_counters.any()


def test_verify_trees_past_the_row_limit_use_tree_groups_then_the_extend_kernel(monkeypatch):
    monkeypatch.setattr(TritonBackend, "max_group_rows", MAX_GROUP_ROWS)   # SPECSERVE_TREE_GROUPS=1
    batch = compare((6, 2, 64), ForwardMode.VERIFY, prefix_lens=[30, 70], extend_lens=[5, 5],
                    tree_mask=random_tree_masks([5, 5]), max_tree_rows=9)
    assert batch.attn_metadata.tree_groups and not batch.attn_metadata.tree_rows
    masks = random_tree_masks([12, 12])   # 12 nodes x 6 heads: 72 rows, more than a program holds
    batch = compare((12, 2, 64), ForwardMode.VERIFY, prefix_lens=[30, 70], extend_lens=[12, 12], tree_mask=masks,
                    max_tree_rows=9)
    assert not batch.attn_metadata.tree_groups and not batch.attn_metadata.tree_rows


def test_verify_chain_without_mask_is_causal():
    compare((6, 2, 64), ForwardMode.VERIFY, prefix_lens=[20, 70], extend_lens=[4, 4])


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.VERIFY])
def test_q_as_a_row_strided_view_of_qkv(mode):
    """The model hands the backend q as a view of the qkv projection (rotated in place by
    fused_ops.rope_and_store), not a contiguous copy: both backends read it through its strides."""
    heads = num_heads, num_kv_heads, head_dim = (6, 2, 64)
    tokens_per_req = 1 if mode is ForwardMode.DECODE else 5
    pool = make_pool(num_kv_heads, head_dim)
    tree_mask = random_tree_masks([tokens_per_req] * 2) if mode is ForwardMode.VERIFY else None
    batch = make_batch(pool, mode, [150, 40], [tokens_per_req] * 2, tree_mask)
    q, k, v = random_qkv(batch.num_tokens, num_heads, num_kv_heads, head_dim)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)   # (num_tokens, (heads + 2 kv_heads) * dim)
    q_view = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    assert not q_view.is_contiguous() and q_view.stride(0) == qkv.shape[1]
    expected = attend(TorchNativeBackend(*heads), batch, q, k, v)
    torch.testing.assert_close(attend(TorchNativeBackend(*heads), batch, q_view, k, v), expected)
    backend = small_splits(TritonBackend(*heads))
    got = attend(backend, batch, q_view, k, v)
    assert batch.attn_metadata.partial_out is not None   # the split path (and for VERIFY its merge kernel) ran
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def padded_graph_batch(pool: KVPool, real: ForwardBatch, bs: int, tokens_per_req: int) -> ForwardBatch:
    """`real` padded to bs requests the way the backend's docstring says a graph batch is."""
    pad = bs - real.batch_size
    long = dict(dtype=torch.long, device=DEVICE)
    tree_mask = None
    if real.tree_mask is not None:
        tree_mask = torch.eye(tokens_per_req, dtype=torch.bool, device=DEVICE).repeat(bs, 1, 1)
        n = real.tree_mask.shape[-1]
        tree_mask[:real.batch_size, :n, :n] = real.tree_mask
    num_tokens = real.num_tokens + pad * tokens_per_req
    return ForwardBatch(
        mode=real.mode, input_ids=torch.zeros(num_tokens, **long), positions=torch.zeros(num_tokens, **long),
        out_slots=torch.cat([real.out_slots, torch.full((pad * tokens_per_req,), PADDING_SLOT, **long)]),
        req_rows=torch.cat([real.req_rows, torch.zeros(pad, **long)]),
        prefix_lens=torch.cat([real.prefix_lens, torch.zeros(pad, **long)]),
        extend_lens=torch.cat([real.extend_lens, torch.full((pad,), tokens_per_req, **long)]),
        prefix_lens_host=real.prefix_lens_host + [0] * pad,
        extend_lens_host=real.extend_lens_host + [tokens_per_req] * pad, kv_pool=pool,
        logits_indices=torch.arange(num_tokens, device=DEVICE), tree_mask=tree_mask)


@pytest.mark.parametrize("mode,path", [(ForwardMode.DECODE, None), (ForwardMode.VERIFY, "extend"),
                                       (ForwardMode.VERIFY, "rows"), (ForwardMode.VERIFY, "groups")])
def test_static_buffers_match_plan(mode, path):
    heads = num_heads, num_kv_heads, head_dim = (6, 2, 64)
    tokens_per_req = 1 if mode is ForwardMode.DECODE else 5
    pool = make_pool(num_kv_heads, head_dim)
    real = make_batch(pool, mode, [60, 3, 200], [tokens_per_req] * 3,
                      random_tree_masks([tokens_per_req] * 3) if mode is ForwardMode.VERIFY else None)
    q, k, v = random_qkv(real.num_tokens, num_heads, num_kv_heads, head_dim)

    def triton_backend() -> TritonBackend:
        return route(small_splits(TritonBackend(*heads), target_programs=24 if path == "extend" else 160), path)
    expected = attend(triton_backend(), real, q, k, v)

    backend = triton_backend()
    # one state serves decode and verify graphs of up to 4 requests
    backend.init_cuda_graph_state(max_bs=4, max_tokens_per_req=5, kv_pool=pool)
    dummy = padded_graph_batch(pool, make_batch(pool, mode, [0], [tokens_per_req],
                                                random_tree_masks([tokens_per_req]) if real.tree_mask is not None
                                                else None), 4, tokens_per_req)
    backend.plan_for_capture(dummy)
    captured = dummy.attn_metadata

    graph_batch = padded_graph_batch(pool, real, 4, tokens_per_req)
    backend.plan_for_replay(graph_batch)
    replayed = graph_batch.attn_metadata
    # a captured graph re-reads the same memory: the replay plan must hand out the same buffers
    for name in ("req_rows", "prefix_lens", "qo_indptr", "tree_mask", "partial_out", "partial_lse"):
        a, b = getattr(captured, name), getattr(replayed, name)
        assert (a is None) == (b is None) and (a is None or a.data_ptr() == b.data_ptr()), name
    assert captured.row_blocks == replayed.row_blocks and replayed.partial_out is not None
    assert captured.tree_rows == replayed.tree_rows == (path == "rows")
    assert captured.tree_groups == replayed.tree_groups == (path == "groups")

    pad_q, pad_k, pad_v = (torch.cat([x, torch.zeros((tokens_per_req, *x.shape[1:]), device=DEVICE)])
                           for x in (q, k, v))
    got = backend.forward(pad_q, pad_k, pad_v, 0, graph_batch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:real.num_tokens], expected, atol=1e-4, rtol=1e-4)
