"""The prefix cache end to end on SmolLM2 (fp32, CPU): outputs are the same with and without
it (greedy and seeded sampling) for shared prefixes, partial matches, multi-turn chat, a
prefix evicted while requests run, preemption of a request whose prefix others hold,
aborts and NGRAM speculation; after each, every KV slot is free or cached exactly once.
Plus the metrics that report it (meta_info, OpenAI usage, /metrics)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specserve.bench.prompts import SAMPLE_PROMPTS
from specserve.engine.engine import core_load
from specserve.engine.stats import SpecCounters
from specserve.server.metrics import ServerMetrics
from specserve.server.openai_api import _usage
from tests.spec_fixtures import CODE_PROMPT, ngram_args, wait_until_all_kv_is_free

GREEDY = {"temperature": 0, "max_new_tokens": 20}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_new_tokens": 20}
SYSTEM = ("You are a careful assistant for a small engineering team. Answer briefly, state your "
          "assumptions, prefer plain words over jargon, and when you show code, keep it short and "
          "runnable. If a question is ambiguous, say which reading you answer. ")


@pytest.fixture(scope="module")
def uncached(engine_factory):
    return engine_factory(disable_radix_cache=True, max_total_tokens=4096)


@pytest.fixture(scope="module")
def cached(engine_factory):
    return engine_factory(max_total_tokens=4096)


@pytest.fixture(scope="module")
def ids(uncached):
    return lambda text: uncached.tokenizer(text).input_ids


@pytest.fixture(scope="module")
def sharing_prompts(ids) -> list[list[int]]:
    """Prompts that share a system prompt, one that shares only half of it (a match ends
    inside a tree node), a repeat (cached but for its last token), and a prompt that is a
    prefix of the others."""
    system = ids(SYSTEM)
    questions = [system + ids(q) for q in SAMPLE_PROMPTS[:4]]
    return questions + [system[:len(system) // 2] + ids(SAMPLE_PROMPTS[4]), list(questions[0]), system[:-5]]


def _outputs(engine, prompts: list[list[int]], params: dict) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_shared_and_partial_prefixes_give_the_same_outputs(uncached, cached, sharing_prompts, params):
    expected = _outputs(uncached, sharing_prompts, params)
    first = cached.generate(input_ids=sharing_prompts, sampling_params=params)
    assert [o["output_ids"] for o in first] == expected
    assert sum(o["meta_info"]["cached_tokens"] for o in first) > 0    # later ones found the system prompt
    wait_until_all_kv_is_free(cached)
    again = cached.generate(input_ids=sharing_prompts, sampling_params=params)
    assert [o["output_ids"] for o in again] == expected
    assert [o["meta_info"]["cached_tokens"] for o in again] == [len(p) - 1 for p in sharing_prompts]
    wait_until_all_kv_is_free(cached)


def test_second_turn_reuses_the_first_turns_prompt_and_output(uncached, cached, ids):
    firsts = [ids(SYSTEM + q) for q in SAMPLE_PROMPTS[4:8]]
    replies = cached.generate(input_ids=firsts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in replies] == _outputs(uncached, firsts, GREEDY)
    seconds = [p + r["output_ids"] + ids(" Now say it again, shorter.") for p, r in zip(firsts, replies)]
    turn_two = cached.generate(input_ids=seconds, sampling_params=GREEDY)
    assert [r["output_ids"] for r in turn_two] == _outputs(uncached, seconds, GREEDY)
    # every token whose KV was written: the prompt and the reply but its last token
    assert [r["meta_info"]["cached_tokens"] for r in turn_two] == [
        len(p) + len(r["output_ids"]) - 1 for p, r in zip(firsts, replies)]
    wait_until_all_kv_is_free(cached)


def test_prefixes_evicted_while_requests_run(engine_factory, uncached, ids):
    """A pool that holds about one group's KV: each group evicts the last one's prefixes while
    it runs, and the first group, sent again, finds part of its prompts gone."""
    engine = engine_factory(max_total_tokens=200, chunked_prefill_size=64, schedule_policy="lpm")
    tree = engine.core.scheduler.kv.tree
    evicted = []
    original_evict = tree.evict
    tree.evict = lambda count: evicted.append(original_evict(count)) or evicted[-1]
    params = {**GREEDY, "max_new_tokens": 12}
    groups = [[ids(f"{system} {q}") for q in SAMPLE_PROMPTS[i:i + 2]]   # ~150 tokens of KV each
              for i, system in ((0, SYSTEM), (3, SYSTEM.upper()), (5, SYSTEM[::-1]))]
    expected = _outputs(uncached, [p for prompts in groups for p in prompts], params)
    expected = [expected[i:i + 2] for i in range(0, len(expected), 2)]
    cached_tokens = []
    for prompts, want in zip(groups + groups[:1], expected + expected[:1]):
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outputs] == want
        cached_tokens.append(sum(o["meta_info"]["cached_tokens"] for o in outputs))
        wait_until_all_kv_is_free(engine)
    assert sum(evicted) > 200 and cached_tokens[-1] < sum(len(p) - 1 for p in groups[0])


def test_preempting_a_request_whose_prefix_others_hold(engine_factory, uncached, sharing_prompts):
    engine = engine_factory(max_total_tokens=240, chunked_prefill_size=64)
    params = {**GREEDY, "max_new_tokens": 48, "ignore_eos": True}
    prompts = sharing_prompts[:4]   # 51 shared tokens, 5-17 more each, + 48 each: ~290 together
    outputs = engine.generate(input_ids=prompts, sampling_params=params)
    assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
    assert [o["output_ids"] for o in outputs] == _outputs(uncached, prompts, params)
    wait_until_all_kv_is_free(engine)


def test_aborting_a_request_whose_prefix_another_uses(uncached, cached, sharing_prompts):
    long_params = {**GREEDY, "max_new_tokens": 400, "ignore_eos": True}
    stream = cached.generate(input_ids=sharing_prompts[2], sampling_params=long_params, stream=True)
    for _ in range(3):
        next(stream)
    others = _outputs(cached, sharing_prompts[:2], GREEDY)   # while the long one decodes
    stream.close()     # aborts it
    assert others == _outputs(uncached, sharing_prompts[:2], GREEDY)
    wait_until_all_kv_is_free(cached)
    assert cached.core.stats.total_tokens > 0 and cached.core.scheduler.kv.tree.match_length(sharing_prompts[2]) \
        == len(sharing_prompts[2])                             # its prompt stays cached, unheld


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_ngram_speculation_with_the_cache(engine_factory, uncached, ids, params):
    engine = engine_factory(**ngram_args(8), max_total_tokens=2048)
    code = ids(CODE_PROMPT)
    prompts = [code, code + ids("# and once more:\n"), code[:len(code) // 2]]
    params = {**params, "max_new_tokens": 32}
    expected = _outputs(uncached, prompts, params)
    for _ in range(2):   # the second round is served from the cache
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o["output_ids"] for o in outputs] == expected
        wait_until_all_kv_is_free(engine)
    assert all(o["meta_info"]["cached_tokens"] == len(p) - 1 for o, p in zip(outputs, prompts))
    assert sum(o["meta_info"]["spec_verify_ct"] for o in outputs) < sum(map(len, expected))   # drafts accepted


def test_metrics_report_cached_tokens():
    assert _usage([{"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 7},
                   {"prompt_tokens": 5, "completion_tokens": 1, "cached_tokens": 0}]) == {
        "prompt_tokens": 15, "completion_tokens": 3, "total_tokens": 18, "prompt_tokens_details": {"cached_tokens": 7}}
    scheduler = SimpleNamespace(running=[], waiting=[], available_slots=lambda: 75, cached_slots=lambda: 30)
    core = SimpleNamespace(scheduler=scheduler, runner=SimpleNamespace(pool=SimpleNamespace(size=100)),
                           spec_counters=SpecCounters())
    metrics = ServerMetrics(lambda: core_load(core), "m")
    for cached_tokens in (30, 0):
        metrics.track(prompt_tokens=40).finish({"completion_tokens": 1, "cached_tokens": cached_tokens,
                                                "finish_reason": {"type": "length"}})
    text = metrics.render().decode()
    assert 'specserve:cached_tokens_total{model_name="m"} 30.0' in text
    assert 'specserve:cache_hit_rate{model_name="m"} 0.375' in text
    assert 'specserve:kv_cached_slots{model_name="m"} 30.0' in text
    assert 'specserve:token_usage{model_name="m"} 0.25' in text


def test_flush_cache_route_empties_the_cache(cached, sharing_prompts):
    from fastapi.testclient import TestClient

    from specserve.server.http import create_app
    cached.generate(input_ids=sharing_prompts[0], sampling_params={**GREEDY, "max_new_tokens": 2})
    wait_until_all_kv_is_free(cached)
    assert cached.core.scheduler.cached_slots() > 0
    with TestClient(create_app(cached, served_model_name="m")) as http:
        reply = http.post("/flush_cache")
        load = http.get("/get_server_info").json()
    assert reply.status_code == 200 and reply.text.startswith("Cache flushed")
    assert cached.core.scheduler.cached_slots() == 0 and load["kv_cached_slots"] == 0
    assert load["kv_free_slots"] == load["kv_total_slots"]
