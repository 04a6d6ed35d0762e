"""The start-up warm-up's plan (engine/warmup_plan.py) and the kernel cache helpers
(engine/kernel_cache.py): which shapes a GPU engine warms, and that they fit the engine."""
from __future__ import annotations

import dataclasses
import os

import torch

from specserve.engine.kernel_cache import TritonCompileCounter, use_persistent_triton_cache
from specserve.engine.warmup_plan import SPLIT_CONTEXT, EngineShape, plan_warmup

# the 1.5B on an H100 with NGRAM-16: graphs for 1..64 requests of 1, 4, 8 or 16 tokens
GPU_ENGINE = EngineShape(cuda=True, graph_batch_sizes=(1, 2, 4, 8, 16, 32, 48, 64), graph_tree_sizes=(1, 4, 8, 16),
                         max_running=256, kv_slots=1_000_000, context_length=32768, chunk_size=2048,
                         num_draft_tokens=16)


def _fits(plan, shape: EngineShape) -> None:
    """Each batch's prompts fit one chunk (so it decodes as a whole) and the cache, with room to grow."""
    for batch in plan.decode_batches + plan.tier_batches:
        prompts = sum(batch.prompt_lengths)
        assert prompts <= shape.chunk_size and batch.size <= shape.max_running
        assert prompts + batch.size * (plan.new_tokens + plan.longest_tier) <= shape.kv_slots
        assert batch.longest + plan.new_tokens + plan.longest_tier < shape.context_length
    for length in plan.prompt_lengths:
        assert length + plan.new_tokens + plan.longest_tier < shape.context_length and length <= shape.kv_slots // 2


def test_gpu_plan_covers_each_chunk_class_graph_bucket_eager_size_and_tier():
    plan = plan_warmup(GPU_ENGINE)
    assert plan.prompt_lengths == (1, 4, 16, 64, 256, 1024, 2048, 3072)  # x4 to the chunk, then a chunk and a half
    sizes = {1, 2, 4, 8, 16, 32, 48, 64, 65, 256}  # the graph buckets, one past the largest, max running
    assert {b.size for b in plan.decode_batches} == sizes
    # outside the graphs also with a context long enough for attention to split its keys
    assert {b.size for b in plan.decode_batches if b.longest == SPLIT_CONTEXT} == {65, 256}
    assert plan.tiers == (4, 8, 16)
    assert {b.size for b in plan.tier_batches} == sizes - {256}  # its logits would take 2.5 GB
    assert plan.late_prompt_length == SPLIT_CONTEXT and plan.sampling_variants
    _fits(plan, GPU_ENGINE)


def test_two_prompts_past_the_largest_prefill_graph_prefill_eagerly_where_chunks_are_larger():
    """Few prompts in an eager prefill split their keys: the extend kernel's variant that only
    such a step builds (H100, 1.5B, 8192-token chunks and 2048-token prefill graphs)."""
    shape = dataclasses.replace(GPU_ENGINE, chunk_size=8192, prefill_graph_tokens=2048)
    plan = plan_warmup(shape)
    [pair] = [b for b in plan.decode_batches if b.long_prompts == 2]
    assert pair.size == 2 and sum(pair.prompt_lengths) > 2048 and pair.prompt_lengths[0] == pair.prompt_lengths[1]
    _fits(plan, shape)
    # chunks no larger than the graphs, or no prefill graphs: no prompt step of two prompts runs eagerly
    for graphs in (8192, 0):
        plain = plan_warmup(dataclasses.replace(shape, prefill_graph_tokens=graphs))
        assert all(b.long_prompts == 1 for b in plain.decode_batches)


def test_plan_without_graphs_or_drafter_decodes_eagerly_at_powers_of_two():
    shape = dataclasses.replace(GPU_ENGINE, graph_batch_sizes=(), graph_tree_sizes=(), num_draft_tokens=None,
                                max_running=100)
    plan = plan_warmup(shape)
    assert {b.size for b in plan.decode_batches} == {1, 2, 4, 8, 16, 32, 64, 100}
    assert plan.tiers == () and plan.tier_batches == ()
    _fits(plan, shape)


def test_plan_without_graphs_verifies_every_power_of_two_tier_up_to_64_requests():
    shape = dataclasses.replace(GPU_ENGINE, graph_batch_sizes=(), graph_tree_sizes=(), num_draft_tokens=8)
    plan = plan_warmup(shape)
    assert plan.tiers == (2, 4, 8) and {b.size for b in plan.tier_batches} == {1, 2, 4, 8, 16, 32, 64}


def test_plan_shrinks_to_a_small_cache_chunk_and_context():
    shape = EngineShape(cuda=True, graph_batch_sizes=(1, 2, 4, 8, 16), graph_tree_sizes=(1, 8), max_running=16,
                        kv_slots=300, context_length=160, chunk_size=64, num_draft_tokens=8)
    plan = plan_warmup(shape)
    assert plan.prompt_lengths == (1, 4, 16, 64, 96)
    assert {b.size for b in plan.decode_batches} == {1, 2, 4, 8}  # 16 prompts would not fit one chunk
    assert plan.late_prompt_length <= 150
    _fits(plan, shape)


def test_plan_without_chunking_stops_at_a_few_thousand_tokens():
    shape = dataclasses.replace(GPU_ENGINE, chunk_size=GPU_ENGINE.context_length)
    assert plan_warmup(shape).prompt_lengths == (1, 4, 16, 64, 256, 1024, 4096, 8192)


def test_a_cpu_engine_gets_no_plan():
    assert plan_warmup(dataclasses.replace(GPU_ENGINE, cuda=False)) is None


def test_triton_cache_goes_under_specserve_cache_dir_unless_chosen(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    assert use_persistent_triton_cache(torch.device("cpu")) is None and "TRITON_CACHE_DIR" not in os.environ
    path = use_persistent_triton_cache(torch.device("cuda"))
    assert path == tmp_path / "triton" and path.is_dir() and os.environ["TRITON_CACHE_DIR"] == str(path)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert use_persistent_triton_cache(torch.device("cuda")) == tmp_path / "mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_compile_counter_counts_through_tritons_hooks_and_puts_them_back():
    from triton import knobs
    runtime = knobs.runtime
    with TritonCompileCounter() as counter:
        for _ in range(2):
            assert runtime.jit_cache_hook(key="k") is None  # a true value would skip the compile
            runtime.jit_post_compile_hook(key="k")
    assert counter.compiles == 2 and counter.seconds >= 0.0
    assert runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None


def test_compile_counter_leaves_hooks_someone_else_set_alone():
    from triton import knobs
    theirs = lambda **_: None
    knobs.runtime.jit_post_compile_hook = theirs
    try:
        with TritonCompileCounter() as counter:
            pass
        assert counter.compiles is None and knobs.runtime.jit_post_compile_hook is theirs
    finally:
        knobs.runtime.jit_post_compile_hook = None
