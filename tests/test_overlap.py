"""Plain decoding one step ahead (the overlap schedule): step N+1 is queued with step N's
argmax (or its tokens sampled on the device) as its roots before step N's tokens are read. On
a GPU that hides the host's work; here (CPU, forced on) it must change nothing: the same outputs
as the normal path, greedy or sampled, whatever ends a request (length, stop string, EOS,
abort, preemption), every KV slot comes back, and unseeded samples keep the exact distribution."""
from __future__ import annotations

import pytest

from specserve.bench.prompts import SAMPLE_PROMPTS
from specserve.engine.step_events import StepListener

from tests.spec_fixtures import tiny_engine
from tests.test_kv_accounting import wait_until_all_kv_is_free
from tests.test_spec_sampling import (NEW_TOKENS, PROMPT, SAMPLES, chi_square_p, exact_joint, model_dir,  # noqa: F401
                                      step_logits)

GREEDY = {"temperature": 0, "max_new_tokens": 24}


def overlapped(engine):
    """Forces the overlap schedule on (it is CUDA-graph-only by default) and counts the steps
    that were read from a launch ahead."""
    from specserve.engine.overlap import OverlapSchedule
    core = engine.core
    schedule = core.overlap = OverlapSchedule(core.runner, core.scheduler, core.sampler)
    used = {"ahead": 0}
    current_step = schedule.current_step

    def counting_current_step(reqs, last_tokens):
        ahead = schedule.ahead
        step = current_step(reqs, last_tokens)
        used["ahead"] += step is ahead
        return step
    schedule.current_step = counting_current_step
    return used


@pytest.fixture(scope="module")
def plain(engine_factory):
    return engine_factory(max_total_tokens=4096)


@pytest.fixture(scope="module")
def ahead(engine_factory):
    engine = engine_factory(max_total_tokens=4096)
    engine.used = overlapped(engine)
    return engine


def requests() -> tuple[list[str], list[dict]]:
    prompts = SAMPLE_PROMPTS[:6]
    params = [dict(GREEDY, max_new_tokens=8 + 5 * i) for i in range(len(prompts))]   # they end at different steps
    params[1] = dict(GREEDY, max_new_tokens=40, ignore_eos=True)
    params[2] = dict(GREEDY, stop=[" the"])
    params[3] = dict(GREEDY, repetition_penalty=1.3)   # not argmax-only: the batch takes the normal path
    return prompts, params


def test_outputs_equal_the_normal_path(plain, ahead):
    prompts, params = requests()
    expected = plain.generate(prompts, params)
    got = ahead.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert [o["text"] for o in got] == [o["text"] for o in expected]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in expected]
    solo = ahead.generate(prompts[1], params[1])     # batch 1 all the way
    assert solo["output_ids"] == expected[1]["output_ids"]
    assert ahead.used["ahead"] > 20                   # the launched-ahead steps were really used
    wait_until_all_kv_is_free(ahead)


def test_sampled_requests_run_ahead_with_the_normal_path_s_tokens(plain, ahead):
    """Seeded requests with each sampling filter, beside greedy ones, and alone: their tokens,
    sampled on the device at each step's launch, are the ones the normal path (the sampler
    after the read) gives, and their steps are launched ahead. Penalties keep them off it."""
    prompts = SAMPLE_PROMPTS[:5]
    sampled = {"temperature": 0.9, "max_new_tokens": 20, "ignore_eos": True}
    params = [dict(sampled, seed=1), dict(sampled, seed=2, top_k=5), dict(sampled, seed=3, top_p=0.8),
              dict(sampled, seed=4, min_p=0.1, max_new_tokens=9), dict(GREEDY, max_new_tokens=14)]
    expected = [o["output_ids"] for o in plain.generate(prompts, params)]
    before = ahead.used["ahead"]
    assert [o["output_ids"] for o in ahead.generate(prompts, params)] == expected
    assert ahead.used["ahead"] - before > 15
    assert ahead.generate(prompts[2], params[2])["output_ids"] == expected[2]   # batch 1 all the way
    before = ahead.used["ahead"]
    penalised = dict(sampled, seed=5, repetition_penalty=1.2)
    assert ahead.generate(prompts[0], penalised)["output_ids"] == plain.generate(prompts[0], penalised)["output_ids"]
    assert ahead.used["ahead"] == before
    wait_until_all_kv_is_free(ahead)


def test_unseeded_samples_run_ahead_with_the_exact_distribution(model_dir, step_logits):
    """test_spec_sampling's tiny target and exact joint distribution of four tokens: plain
    decoding with every step launched ahead, unseeded, at temperature 1 and with top-k."""
    for config in ({"temperature": 1.0}, {"temperature": 0.8, "top_k": 4}):
        with tiny_engine(model_dir[0], max_running_requests=1024, max_total_tokens=32768) as engine:
            used = overlapped(engine)
            params = [{**config, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * SAMPLES
            outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
            wait_until_all_kv_is_free(engine)
        assert used["ahead"] >= NEW_TOKENS - 2
        assert chi_square_p(outputs, exact_joint(step_logits, **config)) > 1e-4, config


def test_constrained_requests_run_ahead_under_their_grammars(plain, ahead):
    """Greedy requests under a JSON schema, a regex and an EBNF grammar, beside an
    unconstrained one: their plain steps are launched ahead on the unmasked argmax, each token
    kept to its request's grammar as its step is read (test_unmasked_plain_steps.py). The
    outputs are those of the normal path token for token, and they parse."""
    import json
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"]}
    prompts = SAMPLE_PROMPTS[:4]
    params = [dict(GREEDY, max_new_tokens=40, json_schema=json.dumps(schema)),
              dict(GREEDY, max_new_tokens=30, regex=r"(yes|no), because [a-z ]{3,20}\."),
              dict(GREEDY, max_new_tokens=30, ebnf='root ::= "Answer: " ("A" | "B" | "C") "."'),
              dict(GREEDY, max_new_tokens=20)]
    expected = plain.generate(prompts, params)
    before = ahead.used["ahead"]
    got = ahead.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert ahead.used["ahead"] - before > 15          # their steps came from launches ahead
    assert set(json.loads(got[0]["text"])) == {"name", "age"}
    assert got[2]["text"] in ("Answer: A.", "Answer: B.", "Answer: C.")
    alone = ahead.generate(prompts[0], params[0])    # batch 1: every step checked as it is read
    assert alone["output_ids"] == expected[0]["output_ids"]
    wait_until_all_kv_is_free(ahead)


def test_abort_while_a_step_is_ahead_frees_everything(ahead):
    stream = ahead.generate(SAMPLE_PROMPTS[0], dict(GREEDY, max_new_tokens=64, ignore_eos=True), stream=True)
    for chunks, _ in enumerate(stream, start=1):
        if chunks == 5:
            break
    stream.close()
    wait_until_all_kv_is_free(ahead)


def test_preemption_with_steps_ahead(engine_factory, plain):
    small = engine_factory(max_total_tokens=160, max_running_requests=8)
    small.used = overlapped(small)
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    expected = plain.generate(SAMPLE_PROMPTS, params)
    got = small.generate(SAMPLE_PROMPTS, params)
    assert sum(o["meta_info"]["preemptions"] for o in got) > 0
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    wait_until_all_kv_is_free(small)


def test_requests_ending_leave_the_others_step_ahead(engine_factory, plain):
    """A request that ends by length (known before the next launch) gets no row in the step
    launched ahead; one that a stop token ends (seen only when its step is read) has its
    row cut from it. Either way the others' step ahead is read, not dropped: every decode
    step but the first comes from a launch ahead. Same outputs, every KV slot back."""
    prompts = SAMPLE_PROMPTS[:4]
    free_run = plain.generate(prompts[1], dict(GREEDY, max_new_tokens=20, ignore_eos=True))["output_ids"]
    stop = free_run[5]   # ends request 1 at its first occurrence, whatever step that is
    params = [dict(GREEDY, max_new_tokens=9, ignore_eos=True), dict(GREEDY, max_new_tokens=20, stop_token_ids=[stop]),
              dict(GREEDY, max_new_tokens=14, ignore_eos=True), dict(GREEDY, max_new_tokens=24, ignore_eos=True)]
    expected = plain.generate(prompts, params)
    assert expected[1]["meta_info"]["finish_reason"]["type"] == "stop"
    engine = engine_factory(max_total_tokens=4096)
    used = overlapped(engine)
    schedule = engine.core.overlap
    current_step, launches = schedule.current_step, {"reads": 0, "prefills": 0}
    extend = engine.core.runner.extend

    def counting_current_step(reqs, last_tokens):
        launches["reads"] += 1
        return current_step(reqs, last_tokens)

    def counting_extend(*args, **kwargs):
        launches["prefills"] += 1
        return extend(*args, **kwargs)
    schedule.current_step, engine.core.runner.extend = counting_current_step, counting_extend
    got = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in expected]
    assert launches["reads"] == 23 and used["ahead"] == launches["reads"] - launches["prefills"], (launches, used)
    wait_until_all_kv_is_free(engine)


def test_a_step_ahead_of_a_prefill_is_kept(engine_factory, plain):
    """A request that arrives while another decodes on the overlap schedule is prefilled
    right after a plain step that launched the next one ahead. That step's tokens are kept
    (committed after the prefill), not thrown away: the same outputs, every KV slot back."""
    from tests.spec_fixtures import ngram_args
    long = dict(GREEDY, max_new_tokens=48, ignore_eos=True)
    short = dict(GREEDY, max_new_tokens=6, ignore_eos=True)
    expected_long = plain.generate(SAMPLE_PROMPTS[0], long)["output_ids"]
    expected_short = [o["output_ids"] for o in plain.generate(SAMPLE_PROMPTS[1:4], short)]
    for extra in ({}, ngram_args(8, adaptive=True)):
        engine = engine_factory(max_total_tokens=4096, **extra)
        overlapped(engine)
        if engine.core.adaptive is not None:   # verifying drafts priced far above plain steps: plain wins
            for batch_size in (1, 2):
                for tier in engine.core.adaptive.tiers:
                    engine.core.adaptive.record_step(batch_size, tier, 0.001 if tier == 1 else 10.0)
        schedule, kept = engine.core.overlap, []
        keep_through = schedule.keep_through

        def counting_keep_through(batch):
            step = keep_through(batch)
            kept.append(step is not None)
            return step
        schedule.keep_through = counting_keep_through
        chunks = iter(engine.generate(SAMPLE_PROMPTS[0], long, stream=True))
        streamed = []
        while len(streamed) < 6:
            streamed += next(chunks)["output_ids"]
        # each arrives while the long request decodes with a step ahead
        got = [engine.generate(prompt, short)["output_ids"] for prompt in SAMPLE_PROMPTS[1:4]]
        for chunk in chunks:
            streamed += chunk["output_ids"]
        assert streamed == expected_long and got == expected_short
        assert sum(kept) >= 2, kept
        wait_until_all_kv_is_free(engine)


def test_adaptive_ngram_overlaps_its_plain_steps(engine_factory, plain):
    """With NGRAM and the adaptive draft length, the steps it decodes plainly are launched
    ahead too; probe steps draft and verify. Outputs stay those of plain decoding."""
    from tests.spec_fixtures import ngram_args
    engine = engine_factory(max_total_tokens=4096, **ngram_args(8, adaptive=True))
    used = overlapped(engine)
    adaptive = engine.core.adaptive
    for batch_size in (1, 2, 4, 8):      # verifying drafts priced far above plain steps: plain wins
        for tier in adaptive.tiers:
            adaptive.record_step(batch_size, tier, 0.001 if tier == 1 else 10.0)
    drafted = {"steps": 0}
    propose = engine.core.drafter.propose

    def counting_propose(reqs, max_nodes):
        drafted["steps"] += 1
        return propose(reqs, max_nodes)
    engine.core.drafter.propose = counting_propose
    # a batch large enough that drafting is probed, not done every step (PROBE_MIN_BATCH)
    prompts = (SAMPLE_PROMPTS * 2)[:8]
    params = [dict(GREEDY, max_new_tokens=30 + i, ignore_eos=True) for i in range(len(prompts))]
    expected = plain.generate(prompts, params)
    got = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert used["ahead"] > 10 and drafted["steps"] > 2
    wait_until_all_kv_is_free(engine)


def test_a_plain_step_with_nothing_in_flight_shows_its_tokens_after_the_next_launch(engine_factory, plain):
    """A plain step in which a request ends is followed by the prefill of the request that
    waited for its place. The drafter and the policy are shown that step's tokens right
    after the prefill is launched, not before it. Outputs stay those of plain decoding; nothing is left over once idle."""
    from tests.spec_fixtures import ngram_args
    engine = engine_factory(max_total_tokens=4096, max_running_requests=2, **ngram_args(8, adaptive=True))
    used = overlapped(engine)
    core = engine.core
    for batch_size in (1, 2):      # verifying drafts priced far above plain steps: plain wins
        for tier in core.adaptive.tiers:
            core.adaptive.record_step(batch_size, tier, 0.001 if tier == 1 else 10.0)
    events = []
    extend, observe = core.runner.extend, core.drafter.observe_batch

    def spied_extend(reqs, *args, **kwargs):
        events.append(("extend", {r.rid for r in reqs}))
        return extend(reqs, *args, **kwargs)

    def spied_observe(reqs, committed):
        events.append(("observe", {r.rid for r in reqs}))
        return observe(reqs, committed)
    core.runner.extend, core.drafter.observe_batch = spied_extend, spied_observe
    prompts = SAMPLE_PROMPTS[:4]
    params = [dict(GREEDY, max_new_tokens=6 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    expected = plain.generate(prompts, params)
    got = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert used["ahead"] > 10
    # right after a prefill's launch: the tokens of requests already decoding (the step before's)
    late = [i for i in range(1, len(events)) if events[i][0] == "observe" and events[i - 1][0] == "extend"
            and events[i][1] and not events[i][1] & events[i - 1][1]]
    assert len(late) >= 2, events
    assert core.ahead.after_plain is None
    wait_until_all_kv_is_free(engine)


def test_plain_steps_index_and_probe_only_every_kth_step(engine_factory, plain, monkeypatch):
    """In plain mode the adaptive engine probes a batch bucket's first step, then at least
    every k-th plain step (k from measured costs: forced to 4 here; a small batch also probes
    a few steps after an admission) and indexes committed tokens into the trie on those steps
    only: each probe proposes from a trie holding every token committed before its step.
    Outputs stay those of plain decoding."""
    from specserve.speculative.adaptive import policy as adaptive_module
    from tests.spec_fixtures import ngram_args
    monkeypatch.setattr(adaptive_module, "PROBE_BUDGET", 1e-12)   # every probe is dear: k = MAX_PROBE_EVERY
    monkeypatch.setattr(adaptive_module, "MAX_PROBE_EVERY", 4)
    engine = engine_factory(max_total_tokens=4096, **ngram_args(8, adaptive=True))
    used = overlapped(engine)
    core, drafter = engine.core, engine.core.drafter
    adaptive = core.adaptive
    for batch_size in (1, 2, 4, 8):      # verifying drafts priced far above plain steps: plain wins
        for tier in adaptive.tiers:
            adaptive.record_step(batch_size, tier, 0.001 if tier == 1 else 10.0)
    steps = []   # per decode step: what it did

    def spy(owner, name, note):
        original = getattr(owner, name)

        def spied(*args, **kwargs):
            result = original(*args, **kwargs)
            if steps:
                note(steps[-1], result)
            return result
        setattr(owner, name, spied)

    class DecodeSteps(StepListener):
        def step_scheduled(self, batch):
            if not batch.is_extend:
                steps.append({"batch_size": len(batch.reqs), "events": []})
    core.events.add(DecodeSteps())
    spy(adaptive, "probe_due", lambda step, due: step["events"].append("due" if due else "skip"))
    spy(drafter, "flush", lambda step, _: step["events"].append("index"))
    probe = core.planner.probe

    def probing(reqs):   # noted with the decode step during which it runs
        steps[-1]["events"].append(("probe", sum(map(len, drafter._pending.values())), len(steps) - 1))
        probe(reqs)
    core.planner.probe = probing
    prompts = (SAMPLE_PROMPTS * 2)[:8]
    params = [dict(GREEDY, max_new_tokens=20 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    expected = plain.generate(prompts, params)
    got = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert used["ahead"] > 10
    # a plain step's probe runs during the next step, once that one has launched
    # (StepsAhead.settle): it opens that step's events, and belongs to the step before
    for before, step in zip(steps, steps[1:]):
        while step["events"] and isinstance(step["events"][0], tuple):
            before["events"].append(step["events"].pop(0))
    by_bucket: dict[int, list[tuple[int, list]]] = {}
    for index, step in enumerate(steps):
        bucket = 1 << (step["batch_size"] - 1).bit_length()
        by_bucket.setdefault(bucket, []).append((index, step["events"]))
    assert any(not step["events"] for step in steps)   # a request ended in these steps
    for bucket, indexed in by_bucket.items():
        # a step that launches none ahead (a request ends in it) neither probes nor counts
        # towards the next probe
        indexed = [(index, e) for index, e in indexed if e]
        events = [e for _, e in indexed]
        probed = [i for i, e in enumerate(events) if e[0] == "due"]
        gaps = [b - a for a, b in zip(probed, probed[1:] + [len(events)])]
        assert probed[0] == 0 and max(gaps) <= 4, (bucket, events)
        if len(events) > 16:
            assert len(probed) < len(events) / 2, (bucket, events)   # most plain steps do not probe
        for index, e in indexed:
            if e[0] == "due":   # handed to the writer while the GPU computes, then the probe, during a later
                # step (its host time hides behind that step): only this step's tokens queued
                assert e[1] == "index" and e[2][0] == "probe" and e[2][1] <= bucket and e[2][2] > index, e
            else:
                assert e == ["skip"], e
    wait_until_all_kv_is_free(engine)
