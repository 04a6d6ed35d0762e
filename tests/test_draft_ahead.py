"""Greedy drafting steps with the next one launched before this one's bookkeeping
(engine/draft_ahead.py). It is on with the overlap schedule (CUDA graphs); here (CPU,
forced on) it must change nothing: plain decoding's outputs whatever ends a request, the
very drafts a synchronous engine proposes, every KV slot back, and a request that arrives
while a step is ahead waits for that step to be committed, not thrown away."""
from __future__ import annotations

import pytest

from specserve.bench.prompts import SAMPLE_PROMPTS
from specserve.engine.draft_ahead import DraftAhead
from specserve.engine.overlap import OverlapSchedule
from specserve.engine.step_events import StepListener

from tests.spec_fixtures import CODE_PROMPT, ngram_args, price_steps
from tests.test_kv_accounting import wait_until_all_kv_is_free

GREEDY = {"temperature": 0, "max_new_tokens": 24}


def ahead_on(engine, plain_steps: bool = True):
    """What a GPU engine has: plain steps and drafting steps launched ahead (plain_steps=False:
    drafting steps alone, so that a step with nothing to draft stays a drafting step)."""
    core = engine.core
    core.overlap = OverlapSchedule(core.runner, core.scheduler, core.sampler) if plain_steps else None
    core.draft_ahead = DraftAhead(core.scheduler)
    return engine


@pytest.fixture(scope="module")
def plain(engine_factory):
    return engine_factory(max_total_tokens=4096)


def requests() -> tuple[list[str], list[dict]]:
    prompts = [CODE_PROMPT] + SAMPLE_PROMPTS[:5]
    params = [dict(GREEDY, max_new_tokens=60, ignore_eos=True)]
    params += [dict(GREEDY, max_new_tokens=8 + 5 * i) for i in range(5)]   # they end at different steps
    params[2] = dict(GREEDY, stop=[" the"])
    params[3] = dict(GREEDY, stop_token_ids=[13])
    params[4] = dict(GREEDY, repetition_penalty=1.3)   # not argmax-only: the batch verifies synchronously
    return prompts, params


@pytest.fixture(scope="module")
def plain_answers(plain) -> tuple[list[dict], dict]:
    """Plain decoding's answers to requests() and to the code prompt alone (80 tokens)."""
    prompts, params = requests()
    return plain.generate(prompts, params), plain.generate(CODE_PROMPT, dict(GREEDY, max_new_tokens=80))


@pytest.mark.parametrize("adaptive", [False, True])
def test_outputs_equal_plain_and_steps_are_taken_from_ahead(engine_factory, plain_answers, adaptive):
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, adaptive=adaptive)))
    if adaptive:
        price_steps(engine, 0.010, 0.001)   # a plain step 10 ms, 1 ms more per verified node
    assert_plain_answers(engine, plain_answers)
    assert engine.core.draft_ahead.steps_taken > 10
    wait_until_all_kv_is_free(engine)


def test_sampled_steps_are_verified_on_the_device_and_taken_from_ahead(engine_factory, plain):
    """Seeded sampling with each filter (the coupled rule: plain decoding's tokens) on an
    n-gram engine: its drafting steps are verified by the sampler on the device
    (Sampler.verify_on_device), launched ahead as greedy ones are, and drafts get accepted."""
    sampled = {"temperature": 0.7, "max_new_tokens": 60, "ignore_eos": True}
    prompts = [CODE_PROMPT] * 3 + SAMPLE_PROMPTS[:2]
    params = [dict(sampled, seed=1), dict(sampled, seed=2, top_k=8), dict(sampled, seed=3, top_p=0.9),
              dict(sampled, seed=4, min_p=0.05, max_new_tokens=20), dict(GREEDY, max_new_tokens=30)]
    expected = [o["output_ids"] for o in plain.generate(prompts, params)]
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8)))
    outputs = engine.generate(prompts, params)
    assert [o["output_ids"] for o in outputs] == expected
    assert engine.core.draft_ahead.steps_taken > 10
    assert max(o["meta_info"]["spec_accept_length"] for o in outputs) > 1.5
    solo = engine.generate(CODE_PROMPT, params[0])   # batch 1 all the way
    assert solo["output_ids"] == expected[0]
    wait_until_all_kv_is_free(engine)


def assert_plain_answers(engine, plain_answers) -> None:
    """The engine answers requests() and the code prompt alone as plain decoding did, and
    drafts the latter well."""
    prompts, params = requests()
    expected, expected_solo = plain_answers
    got = engine.generate(prompts, params)
    for key in ("output_ids", "text"):
        assert [o[key] for o in got] == [o[key] for o in expected]
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in expected]
    solo = engine.generate(CODE_PROMPT, dict(GREEDY, max_new_tokens=80))   # batch 1 all the way
    assert solo["output_ids"] == expected_solo["output_ids"]
    assert solo["meta_info"]["spec_accept_length"] > 2


def test_only_drafting_steps_launched_ahead_price_their_tier_steadily(engine_factory, plain_answers):
    """adaptive/costs.py: a drafting step the scheduler asked for (the first after plain steps)
    also paid for its proposal; the steps launched ahead after it are what drafting costs."""
    engine = price_steps(ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, adaptive=True))), 0.010, 0.001)
    record, steps = engine.core.adaptive.record_step, []

    def recording(batch_size, tree_size, seconds, tokens=None, steady=True, nodes=None, prefill=False):
        steps.append((tree_size, steady))
        record(batch_size, tree_size, seconds, tokens, steady, nodes, prefill)
    engine.core.adaptive.record_step = recording
    out = engine.generate(CODE_PROMPT, dict(GREEDY, max_new_tokens=80))   # batch 1 all the way
    assert out["output_ids"] == plain_answers[1]["output_ids"]
    drafting = [(i, steady) for i, (size, steady) in enumerate(steps) if size > 1]
    assert not drafting[0][1], steps[:drafting[0][0] + 1]   # the first launched when the scheduler asked
    after_drafting = [steady for i, steady in drafting if steps[i - 1][0] > 1]
    # one batch: each launched ahead of its reading (~12 drafting steps of ~6-7 tokens; a short proposal
    # the policy keeps plain, its tier priced at a drafting step's fixed part, starts a new run)
    assert len(after_drafting) >= 8 and all(after_drafting)
    wait_until_all_kv_is_free(engine)


def _proposals(engine, prompt: str, max_new_tokens: int) -> tuple[list, list[int]]:
    drafter, seen = engine.core.drafter, []
    propose = drafter.propose

    def recording(reqs, max_nodes):
        proposal, num_nodes = propose(reqs, max_nodes)
        seen.append((proposal.tokens.tolist(), proposal.parents.tolist(), list(num_nodes)))
        return proposal, num_nodes
    drafter.propose = recording
    out = engine.generate(prompt, dict(GREEDY, max_new_tokens=max_new_tokens))
    return seen, out["output_ids"]


def test_drafts_are_those_of_synchronous_steps(engine_factory):
    """What a proposal sees (the trie as of the last hand-over, the committed tokens) does
    not depend on when the drafting step is launched, so the drafts are the same step by step
    (without plain steps ahead, which a proposal of roots alone hands the batch to, so that
    the drafting steps launched ahead are all there is to compare)."""
    sync = engine_factory(max_total_tokens=4096, **ngram_args(8))
    ahead = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8)), plain_steps=False)
    expected, expected_ids = _proposals(sync, CODE_PROMPT, 64)
    got, ids = _proposals(ahead, CODE_PROMPT, 64)
    assert ids == expected_ids
    assert got == expected and len(got) > 5
    assert ahead.core.draft_ahead.steps_taken > 5


class LaunchRecorder(StepListener):
    def __init__(self):
        self.launches: list[tuple[str, int, bool]] = []

    def step_launched(self, kind, nodes, from_ahead):
        self.launches.append((kind, nodes, from_ahead))


STORY, STORY_PARAMS = SAMPLE_PROMPTS[4], dict(GREEDY, max_new_tokens=64, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_story(plain) -> list[int]:
    """Plain decoding's answer to the story below, once for both parametrizations of the test."""
    return plain.generate(STORY, STORY_PARAMS)["output_ids"]


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_batch_that_runs_dry_decodes_on_plain_steps_launched_ahead(engine_factory, plain_story, adaptive):
    """A drafting step's successor whose proposal holds roots alone runs as a plain step
    launched ahead, and the plain steps after it too while the drafter still proposes nothing;
    a proposal with drafts ends the stretch. The outputs are plain decoding's."""
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, adaptive=adaptive)))
    if adaptive:
        price_steps(engine, 0.010, 0.001)
    recorder = LaunchRecorder()
    engine.core.events.add(recorder)
    overlap, openers = engine.core.overlap, []   # whether each stretch's first step launched a step after it
    launch_next = overlap.launch_next

    def recording(current, batch, keep):
        openers.append(current.opens_dry_stretch)
        launch_next(current, batch, keep)
    overlap.launch_next = recording
    got = engine.generate(STORY, STORY_PARAMS)   # a story: a few drafts (names it repeats), stretches without
    # a stretch's first step is read before the next is launched: its token may start a match
    assert openers and not any(openers)
    assert got["output_ids"] == plain_story
    launches = recorder.launches[1:]   # after the prefill
    drafting = [nodes for kind, nodes, _ in launches if kind == "draft"]
    assert drafting and min(drafting) > 1, launches   # no step verified roots alone
    runs, run = [], 0   # stretches of plain steps, each launched ahead
    for kind, _, from_ahead in launches:
        if kind == "plain" and from_ahead:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert max(runs + [run]) >= 3, launches
    wait_until_all_kv_is_free(engine)


def test_a_larger_batch_with_nothing_to_draft_verifies_roots_alone(engine_factory, plain):
    """Above DRY_STRETCH_MAX_BATCH a drafting step's successor whose proposal holds roots alone
    stays a drafting step launched ahead: no stretch of plain steps opens (on a GPU at batch 8
    they cost the repeated turn 10-20%). The outputs are plain decoding's."""
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8)))
    recorder = LaunchRecorder()
    engine.core.events.add(recorder)
    overlap, opened = engine.core.overlap, []
    launch_ahead = overlap.launch_ahead

    def recording(reqs, opens_dry_stretch=False):
        opened.append((len(reqs), opens_dry_stretch))
        return launch_ahead(reqs, opens_dry_stretch)
    overlap.launch_ahead = recording
    prompts = [SAMPLE_PROMPTS[4], SAMPLE_PROMPTS[3]]   # stories: stretches without drafts
    params = dict(GREEDY, max_new_tokens=48, ignore_eos=True)
    got = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in plain.generate(prompts, params)]
    assert not any(size > 1 and dry for size, dry in opened), opened
    assert ("draft", 1, True) in recorder.launches, recorder.launches   # roots alone, verified
    wait_until_all_kv_is_free(engine)


def _step_until_ahead(core, reqs, limit: int = 50) -> None:
    for _ in range(limit):
        core.step()
        if core.draft_ahead.step is not None:
            return
        assert not any(r.finished for r in reqs)
    raise AssertionError("no drafting step was launched ahead")


def _stepped_by_hand(engine):
    """The engine's step loop stopped (the test steps the core itself), with a fresh drafter:
    shutting down closed the engine's."""
    engine.shutdown()
    engine.core.drafter = engine.core.drafter.scratch()
    return engine.core


def _drive(engine, prompt: str, params: dict, rid: str):
    return engine._make_request(engine.tokenizer(prompt).input_ids, params, False, 0, rid)


# each with the next step forecast too (--speculative-ngram-forecast: the step ahead is then
# launched before the step before it is read)
FORECAST = pytest.mark.parametrize("forecast", [0, 2])


ARRIVING_PROMPTS, ARRIVING_PARAMS = [CODE_PROMPT, SAMPLE_PROMPTS[0]], dict(GREEDY, max_new_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_arriving(plain) -> list[list[int]]:
    """Plain decoding's answers to the two requests below, once for both parametrizations."""
    return [o["output_ids"] for o in plain.generate(ARRIVING_PROMPTS, ARRIVING_PARAMS)]


@FORECAST
def test_a_request_arriving_while_a_step_is_ahead_waits_for_its_commit(engine_factory, plain_arriving, forecast):
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, speculative_ngram_forecast=forecast)))
    core = _stepped_by_hand(engine)
    params = ARRIVING_PARAMS
    first = _drive(engine, ARRIVING_PROMPTS[0], params, "first")
    core.add_request(first)
    _step_until_ahead(core, [first])
    before = len(first.output_ids)
    second = _drive(engine, ARRIVING_PROMPTS[1], params, "second")
    core.add_request(second)
    outputs = core.step()   # the step ahead, read and committed: no prefill yet
    assert [o.req for o in outputs] == [first] and len(first.output_ids) > before
    assert core.draft_ahead.step is None and second.kv_len == 0
    while core.has_work():
        core.step()
    assert [first.output_ids, second.output_ids] == plain_arriving
    core.scheduler.check_kv()
    assert core.scheduler.available_slots() == core.runner.pool.size


@FORECAST
def test_abort_while_a_step_is_ahead_frees_its_slots(engine_factory, forecast):
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, speculative_ngram_forecast=forecast)))
    core = _stepped_by_hand(engine)
    params = dict(GREEDY, max_new_tokens=40, ignore_eos=True)
    reqs = [_drive(engine, prompt, params, f"r{i}") for i, prompt in enumerate([CODE_PROMPT, CODE_PROMPT])]
    for req in reqs:
        core.add_request(req)
    _step_until_ahead(core, reqs)
    core.abort(reqs[0].rid)
    assert core.draft_ahead.step is None
    while core.has_work():
        core.step()
    assert reqs[1].finished and len(reqs[1].output_ids) == 40
    core.scheduler.check_kv()
    assert core.scheduler.available_slots() == core.runner.pool.size


SMALL_CACHE_PROMPTS = [CODE_PROMPT[:120]] + SAMPLE_PROMPTS[:5]
SMALL_CACHE_PARAMS = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module")
def plain_small_cache(plain) -> list[list[int]]:
    """Plain decoding's answers (a roomy cache), once for both parametrizations of the test."""
    return [o["output_ids"] for o in plain.generate(SMALL_CACHE_PROMPTS, SMALL_CACHE_PARAMS)]


@FORECAST
def test_a_small_cache_preempts_and_keeps_outputs(engine_factory, plain_small_cache, forecast):
    small = ahead_on(engine_factory(max_total_tokens=200, max_running_requests=8,
                                    **ngram_args(8, speculative_ngram_forecast=forecast)))
    got = small.generate(SMALL_CACHE_PROMPTS, SMALL_CACHE_PARAMS)
    assert sum(o["meta_info"]["preemptions"] for o in got) > 0
    assert [o["output_ids"] for o in got] == plain_small_cache
    wait_until_all_kv_is_free(small)


@pytest.mark.parametrize("method,forecast", [("observe_batch", 0), ("propose", 0), ("observe_batch", 2)])
def test_a_failure_around_a_step_ahead_fails_its_request_alone(engine_factory, method, forecast):
    """observe runs after the next step is launched (that step is dropped with the failed
    one), propose while launching it: either way the victim fails alone and nothing leaks."""
    from tests.test_failure_isolation import assert_all_kv_free, failing_for_victim, run_together
    engine = ahead_on(engine_factory(max_total_tokens=2048, max_running_requests=8,
                                     **ngram_args(4, speculative_ngram_forecast=forecast)))
    expected = run_together(engine)
    taken = engine.core.draft_ahead.steps_taken
    with failing_for_victim(engine.core, "drafter", method, 4) as calls:
        results = run_together(engine)
    assert calls["failed"] >= 2 and taken > 0
    assert isinstance(results[1], RuntimeError) and "injected failure" in str(results[1])
    assert [results[0]["output_ids"], results[2]["output_ids"]] == [expected[0]["output_ids"],
                                                                    expected[2]["output_ids"]]
    assert_all_kv_free(engine)


def test_a_failing_forecast_fails_no_request_and_leaks_nothing(engine_factory):
    """A forecast runs only for a batch whose next step is launched ahead, so the failure
    isolation's one-by-one steps (none ahead) never meet it: the batch's requests all finish
    with plain decoding's outputs, and the failed steps' slots (the step whose read the
    forecast came before) are all back."""
    from tests.test_failure_isolation import assert_all_kv_free, failing_for_victim, run_together
    engine = ahead_on(engine_factory(max_total_tokens=2048, max_running_requests=8,
                                     **ngram_args(4, speculative_ngram_forecast=2)))
    expected = run_together(engine)
    with failing_for_victim(engine.core, "drafter", "forecast", 4) as calls:
        results = run_together(engine)
    assert calls["failed"] >= 1
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in expected]
    assert_all_kv_free(engine)


def test_a_replayed_graph_s_outputs_cut_to_the_batch_when_read():
    """A replay's outputs are views of the graph's, made when first read (a greedy step
    reads only its outcome); they equal the graph's cut to (bs, m)."""
    import torch

    from specserve.runner.cuda_graph import CutStepOutputs
    from specserve.runner.tree_step import TreeStepOutputs
    from specserve.verify.tree import DraftTrees
    bucket, n, bs, m = 4, 8, 3, 5
    trees = DraftTrees.chain(torch.arange(bucket * n).view(bucket, n))
    full = TreeStepOutputs(torch.randn(bucket, n, 11), trees, torch.arange(bucket * (1 + 2 * n)).view(bucket, -1),
                           torch.randn(bucket, n, 6))
    cut = CutStepOutputs(full, bs, m)
    assert torch.equal(cut.outcome, full.outcome[:bs]) and cut.outcome.data_ptr() == full.outcome.data_ptr()
    assert torch.equal(cut.logits, full.logits[:bs, :m]) and torch.equal(cut.hidden, full.hidden[:bs, :m])
    assert torch.equal(cut.trees.ancestor_mask, trees.ancestor_mask[:bs, :m, :m])
    assert CutStepOutputs(full, bucket, n).outcome is full.outcome
    assert CutStepOutputs(TreeStepOutputs(full.logits, None, None), bs, m).trees is None


def greedy_constrained_requests() -> tuple[list[str], list[dict]]:
    from tests.test_structured_output import constrained_requests
    requests = [(prompt, params) for _, prompt, params in constrained_requests() if params["temperature"] == 0]
    return [p for p, _ in requests], [q for _, q in requests]


@pytest.fixture(scope="module")
def plain_constrained(plain) -> list[list[int]]:
    """Plain decoding's answers to the greedy constrained requests, once for both parametrizations."""
    return [o["output_ids"] for o in plain.generate(*greedy_constrained_requests())]


@FORECAST
def test_constrained_drafting_steps_are_launched_ahead(engine_factory, plain_constrained, forecast):
    """Verified unmasked, then kept to their grammars on the host (grammar/greedy_paths.py),
    constrained greedy drafting steps run launched ahead like the others, plain's outputs."""
    prompts, params = greedy_constrained_requests()
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(6, speculative_ngram_forecast=forecast)))
    got = engine.generate(prompts, params)
    assert [o["output_ids"] for o in got] == plain_constrained
    assert engine.core.draft_ahead.steps_taken > 10
    wait_until_all_kv_is_free(engine)
