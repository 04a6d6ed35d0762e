"""Prefill that does not starve decoding: the pacer's chunk sizes, and the scheduler's
alternating and mixed steps, on a tiny KV pool with requests stepped by hand (no model).
The end-to-end figure (a 4k prompt arriving while 8 streams run) is a benchmark:
python -m lab.prefill_stall."""
from __future__ import annotations

import random
import statistics
import time

import pytest
import torch

from specserve.engine.prefill_pacer import MIN_CHUNK, PREFILL_SHARE, PrefillPacer
from specserve.engine.scheduler import Scheduler
from specserve.kv.pool import KVPool
from specserve.request.req import Batch, Req
from specserve.request.sampling_params import SamplingParams


def test_pacer_starts_small_and_converges_to_the_share_of_a_decode_step():
    decode_s, fixed_s, per_token_s = 0.040, 0.015, 0.002     # the CPU's shape: a prefill step has a fixed cost
    pacer = PrefillPacer(max_chunk=2048)
    assert pacer.budget(decoding=False) == 2048                 # nobody waits: whole chunks
    assert pacer.budget(decoding=True) == MIN_CHUNK             # nothing measured yet
    pacer.record(decode_s, prefill_tokens=0, decode_reqs=8)
    for _ in range(30):
        chunk = pacer.budget(decoding=True)
        pacer.record(fixed_s + per_token_s * chunk, prefill_tokens=chunk, decode_reqs=0)
    step_s = fixed_s + per_token_s * pacer.budget(decoding=True)
    assert abs(step_s - PREFILL_SHARE * decode_s) < 0.05 * decode_s


def test_pacer_amortizes_a_fixed_cost_above_the_target():
    """The GPU's shape: an eager prefill step costs more than the target whatever its size.
    The chunk must not shrink to MIN_CHUNK (requests then took seconds to start); it grows,
    at most doubling per step, to where its tokens cost about as much as the fixed part."""
    decode_s, fixed_s, per_token_s = 0.002, 0.030, 15e-6
    pacer = PrefillPacer(max_chunk=8192)
    pacer.record(decode_s, prefill_tokens=0, decode_reqs=32)
    chunks = []
    for _ in range(40):
        chunks.append(pacer.budget(decoding=True))
        pacer.record(fixed_s + per_token_s * chunks[-1], prefill_tokens=chunks[-1], decode_reqs=0)
    assert all(b <= 2 * a for a, b in zip(chunks, chunks[1:]))
    assert abs(chunks[-1] - fixed_s / per_token_s) < 0.05 * fixed_s / per_token_s
    assert sum(chunks[-10:]) / (10 * fixed_s + per_token_s * sum(chunks[-10:])) > 0.45 / per_token_s


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_fixed_cost_above_the_target_is_amortized_through_noisy_steps(seed):
    """The GPU's shape with noise: a prefill step's fixed cost (30 ms) above the 25-ms target,
    its steps 10% apart from run to run, some of them under the target. The chunk must stay
    where its tokens amortize the fixed part (~1400 tokens here), not fall to MIN_CHUNK: a
    pacer that trusted the fixed part only when every recent step was over the target
    prefilled at ~130 tokens/s here against ~23,000."""
    rnd = random.Random(seed)
    decode_s, fixed_s, per_token_s = 0.002, 0.030, 20e-6
    pacer = PrefillPacer(max_chunk=8192)
    chunks = []
    for _ in range(300):
        pacer.record(decode_s * rnd.lognormvariate(0, 0.1), prefill_tokens=0, decode_reqs=32)
        chunks.append(pacer.budget(decoding=True))
        pacer.record((fixed_s + per_token_s * chunks[-1]) * rnd.lognormvariate(0, 0.1), prefill_tokens=chunks[-1],
                     decode_reqs=0)
    assert statistics.median(chunks[50:]) > 500


def test_pacer_follows_costs_that_drift_at_one_chunk_size():
    decode_s, per_token_s = 0.040, 0.002
    pacer = PrefillPacer(max_chunk=2048)
    pacer.record(decode_s, prefill_tokens=0, decode_reqs=4)
    for _ in range(20):
        chunk = pacer.budget(decoding=True)
        pacer.record(per_token_s * chunk, prefill_tokens=chunk, decode_reqs=0)
    steady = pacer.budget(decoding=True)
    for _ in range(20):   # deep into the prompt: each chunk also attends to a long prefix
        chunk = pacer.budget(decoding=True)
        pacer.record(0.030 + per_token_s * chunk, prefill_tokens=chunk, decode_reqs=0)
    assert pacer.budget(decoding=True) < steady
    assert abs(0.030 + per_token_s * pacer.budget(decoding=True) - PREFILL_SHARE * decode_s) < 0.1 * decode_s


def test_pacer_mixed_steps_count_only_the_prefill_part_and_respect_the_bounds():
    pacer = PrefillPacer(max_chunk=1024)
    pacer.record(0.040, prefill_tokens=0, decode_reqs=4)
    pacer.record(0.040 + 100 * 0.0001, prefill_tokens=100, decode_reqs=4)    # 0.1 ms per prompt token
    assert abs(pacer.budget(decoding=True) - PREFILL_SHARE * 0.040 / 0.0001) <= 1
    slow = PrefillPacer(max_chunk=1024)
    slow.record(0.040, prefill_tokens=0, decode_reqs=4)
    slow.record(0.040 + 2.0, prefill_tokens=10, decode_reqs=4)               # dreadfully slow tokens
    slow.record(0.040 + 4.0, prefill_tokens=20, decode_reqs=4)
    assert slow.budget(decoding=True) == MIN_CHUNK
    fast = PrefillPacer(max_chunk=512)
    fast.record(1.0, prefill_tokens=0, decode_reqs=1)
    fast.record(1e-9, prefill_tokens=10, decode_reqs=0)
    assert fast.budget(decoding=True) == 512


# ---- the scheduler, stepped by hand ----
def _pool(size: int = 8192) -> KVPool:
    return KVPool(1, 1, 2, size, max_requests=16, max_context=8192, dtype=torch.float32, device=torch.device("cpu"))


def _req(rid: str, prompt_len: int) -> Req:
    return Req(rid=rid, prompt_ids=[5] * prompt_len, params=SamplingParams(), detokenizer=None, seed=0,
               stop_ids=frozenset(), max_new_tokens=1000)


def _run(scheduler: Scheduler, batch: Batch) -> None:
    """What a step does to the scheduler's state: KV for every token fed, a token per sampling request."""
    lens = batch.extend_lens if batch.is_extend else [1] * batch.size
    samples = batch.samples if batch.is_extend else [True] * batch.size
    for req, length, sample in zip(batch.reqs, lens, samples):
        scheduler.append_kv([req], [scheduler.alloc_slots(length)], write_table=False)
        if sample:   # as the committer does: a stream's first token is timed
            req.output_ids.append(7)
            req.first_token_time = req.first_token_time or time.perf_counter()


def _decoding_scheduler(mixed: bool) -> tuple[Scheduler, list[Req], Req]:
    """Four requests decoding, the pacer's costs known, then a 4,000-token prompt arrives."""
    scheduler = Scheduler(_pool(), max_running_requests=16, chunked_prefill_size=2048, enable_mixed_chunk=mixed)
    streams = [_req(f"s{i}", 10) for i in range(4)]
    for req in streams:
        scheduler.add(req)
    _run(scheduler, scheduler.schedule())                      # nobody decodes: one prefill for all four
    assert all(len(r.output_ids) == 1 for r in streams)
    scheduler.pacer.record(0.040, prefill_tokens=0, decode_reqs=4)
    scheduler.pacer.record(0.002 * 100, prefill_tokens=100, decode_reqs=0)     # 2 ms per prompt token
    long_prompt = _req("long", 4000)
    scheduler.add(long_prompt)
    return scheduler, streams, long_prompt


def test_a_prompt_of_the_same_burst_is_not_paced_for_streams_that_started_after_it_arrived():
    """Requests arriving together: the first ones stream, the pacer's costs are known, but the
    prompt that arrived with them takes whole chunks (prefill first, as in SGLang), and is
    paced only for a stream whose first token came before it arrived."""
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=False)
    long_prompt.arrival_time = min(r.arrival_time for r in streams)   # arrived with them, queued behind
    _run(scheduler, scheduler.schedule())   # the streams' turn: steps still alternate
    batch = scheduler.schedule()
    assert batch.is_extend and batch.reqs == [long_prompt] and batch.extend_lens == [2048]
    _run(scheduler, batch)
    _run(scheduler, scheduler.schedule())
    latecomer = _req("late", 1500)   # arrives now, while the streams run: paced for their sake
    scheduler.add(latecomer)
    while long_prompt.kv_len < 4000:   # the burst's prompt unpaced, sharing its steps with the latecomer
        batch = scheduler.schedule()
        assert not batch.is_extend or sum(batch.extend_lens) >= 1024   # not the pacer's 30
        _run(scheduler, batch)
    kinds = []
    while latecomer.kv_len < 1499:
        batch = scheduler.schedule()
        kinds.append("prefill" if batch.is_extend else "decode")
        assert not batch.is_extend or batch.reqs == [latecomer] and batch.extend_lens[0] <= 30
        _run(scheduler, batch)
    assert kinds.count("decode") >= kinds.count("prefill") - 1


def test_prefill_chunks_alternate_with_decode_steps():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=False)
    expected_chunk = int(PREFILL_SHARE * 0.040 / 0.002)
    kinds = []
    while long_prompt.kv_len < 4000:
        batch = scheduler.schedule()
        kinds.append("prefill" if batch.is_extend else "decode")
        if batch.is_extend:
            assert batch.reqs == [long_prompt] and batch.extend_lens[0] == min(expected_chunk, 4000 - long_prompt.kv_len)
        else:
            assert batch.reqs == streams
        _run(scheduler, batch)
    assert kinds[:4] == ["decode", "prefill", "decode", "prefill"]   # the streams had just been prefilled
    assert all(a != b for a, b in zip(kinds, kinds[1:]))      # never two steps of the same kind in a row
    assert len(streams[0].output_ids) == 1 + kinds.count("decode")   # the streams kept flowing
    assert scheduler.schedule().reqs == streams + [long_prompt]       # all decode together afterwards


def test_mixed_chunks_decode_in_every_prefill_step():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=True)
    steps = 0
    while long_prompt.kv_len < 4000:
        batch = scheduler.schedule()
        assert batch.is_extend and batch.reqs[:4] == streams and batch.reqs[4] is long_prompt
        assert batch.extend_lens[:4] == [1] * 4 and batch.samples[:4] == [True] * 4
        _run(scheduler, batch)
        steps += 1
    assert all(len(r.output_ids) == 1 + steps for r in streams)
    assert scheduler._last_step == (batch.extend_lens[4], 4)     # timed as 4 decodes + the chunk


def test_a_prompt_with_one_token_left_is_in_a_mixed_step_once():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=True)
    scheduler.pacer = PrefillPacer(max_chunk=3999)                          # a chunk one token short
    scheduler.pacer.record(0.040, prefill_tokens=0, decode_reqs=4)
    scheduler.pacer.record(1e-6, prefill_tokens=1000, decode_reqs=0)
    _run(scheduler, scheduler.schedule())
    assert long_prompt.kv_len == long_prompt.num_tokens - 1 and not long_prompt.output_ids
    batch = scheduler.schedule()
    assert sum(r is long_prompt for r in batch.reqs) == 1
    _run(scheduler, batch)
    assert long_prompt.output_ids == [7]


def test_prefill_goes_first_while_nobody_decodes():
    scheduler = Scheduler(_pool(), max_running_requests=16, chunked_prefill_size=1024)
    long_prompt = _req("long", 3000)
    scheduler.add(long_prompt)
    assert scheduler.schedule().extend_lens == [1024]


def test_focus_schedules_only_the_given_requests():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=False)
    scheduler.focus = [streams[2]]
    batch = scheduler.schedule()
    assert not batch.is_extend and batch.reqs == [streams[2]]
    scheduler.focus = [long_prompt]
    batch = scheduler.schedule()
    assert batch.is_extend and batch.reqs == [long_prompt] and batch.extend_lens == [2048]   # nobody else runs
    scheduler.focus = None
    assert scheduler.schedule().reqs == streams


def test_trim_kv_drops_slots_committed_ahead_of_their_tokens():
    scheduler, streams, _ = _decoding_scheduler(mixed=False)
    req = streams[0]
    free = scheduler.pool.slots.available()
    scheduler.append_kv([req], [scheduler.alloc_slots(1)], write_table=False)   # KV committed, token not
    assert req.kv_len == req.num_tokens
    scheduler.trim_kv(req)
    assert req.kv_len == req.num_tokens - 1 and scheduler.pool.slots.available() == free


@pytest.mark.parametrize("mode, prefix_lens, extend_lens", [
    ("EXTEND", [9, 600, 3], [1, 7, 1]),               # a mixed step: two decoding requests, a deep prompt chunk
    ("DECODE", [3, 900, 40, 300], [1, 1, 1, 1]),      # one long context among short ones
    ("VERIFY", [5, 700, 20], [3, 4, 2]),              # draft trees
])
def test_grouped_attention_equals_one_padded_call(mode, prefix_lens, extend_lens):
    """The reference backend attends requests of different kinds and key lengths in
    separate calls (short ones are not padded to the longest); same result as one call."""
    from specserve.attention.base import ForwardBatch, ForwardMode
    from specserve.attention.torch_native import LayoutGroup, TorchNativeBackend, build_padded_layout
    heads, kv_heads, head_dim = 6, 2, 16
    pool = KVPool(1, kv_heads, head_dim, 2048, max_requests=4, max_context=1024, dtype=torch.float32,
                  device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for buffer in pool.k_buffers + pool.v_buffers:
        buffer.copy_(torch.randn(buffer.shape, generator=gen))
    rows = [pool.alloc_row() for _ in prefix_lens]
    slots = torch.randperm(2048, generator=gen)[:sum(prefix_lens) + sum(extend_lens)] + 1
    start = 0
    for row, prefix in zip(rows, prefix_lens):
        pool.write_positions(row, 0, slots[start:start + prefix].to(torch.int32))
        start += prefix
    tree_mask = None
    if mode == "VERIFY":   # chains: node i sees nodes 0..i
        n = max(extend_lens)
        tree_mask = torch.stack([torch.tril(torch.ones(n, n, dtype=torch.bool)) & (torch.arange(n) < e)
                                 for e in extend_lens])
    tokens = sum(extend_lens)
    batch = ForwardBatch(mode=ForwardMode[mode], input_ids=torch.zeros(tokens, dtype=torch.long),
                         positions=torch.zeros(tokens, dtype=torch.long), out_slots=slots[start:],
                         req_rows=torch.tensor(rows), prefix_lens=torch.tensor(prefix_lens),
                         extend_lens=torch.tensor(extend_lens), prefix_lens_host=prefix_lens,
                         extend_lens_host=extend_lens, kv_pool=pool, logits_indices=torch.arange(tokens),
                         tree_mask=tree_mask)
    q, k, v = (torch.randn((tokens, n, head_dim), generator=gen) for n in (heads, kv_heads, kv_heads))
    backend = TorchNativeBackend(heads, kv_heads, head_dim)
    backend.plan(batch)
    assert len(batch.attn_metadata) >= 2
    grouped = backend.forward(q, k, v, 0, batch)
    batch.attn_metadata = [LayoutGroup(None, build_padded_layout(batch))]
    torch.testing.assert_close(grouped, backend.forward(q, k, v, 0, batch), atol=1e-5, rtol=1e-5)


def test_chunk_size_default_follows_the_gpu_memory(monkeypatch):
    """--chunked-prefill-size unset: 8192 on a GPU of 60 GiB or more (SGLang's on an H100/H200),
    2048 on a smaller one and on a CPU; a given size stands, -1 is the whole context."""
    from types import SimpleNamespace

    from specserve.runner.model_runner import prefill_chunk_size
    gpu = torch.device("cuda", 0)
    for gib, expected in ((80, 8192), (141, 8192), (24, 2048)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, gib=gib: SimpleNamespace(
            total_memory=gib * 2 ** 30))
        assert prefill_chunk_size(None, gpu, 32768) == expected
    assert prefill_chunk_size(None, torch.device("cpu"), 32768) == 2048
    assert prefill_chunk_size(512, gpu, 32768) == 512
    assert prefill_chunk_size(-1, torch.device("cpu"), 32768) == 32768
