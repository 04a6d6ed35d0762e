"""No KV slot or req_to_token row leaks with speculation, however a request ends: normal
finish (max_new_tokens, a stop token inside an accepted path, min_new_tokens, sampled
requests), abort mid-stream, abort_request, preemption, a cache too small for the drafts
(the core falls back to root-only trees) and the context-length limit. Plus unit tests of
NgramDrafter.propose.

Engines run a random-weight tiny model from a Hugging Face directory (fast); each prompt
is run twice where long accepted paths matter, since the second run drafts from the
first's output.
"""
from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

import specserve.engine.verify_step
from specserve.speculative.adaptive.draft_cuts import fit_to_free_slots
from specserve.speculative.ngram.drafter import NgramDrafter
from specserve.speculative.ngram.trie import NgramConfig
from tests.spec_fixtures import (
    AllocSpy,
    make_tiny_directory,
    ngram_args,
    plain_greedy_outputs,
    tiny_engine,
    truncated_mid_path,
    wait_until_all_kv_is_free,
)

PROMPTS = [
    [5, 6, 7, 8, 9] * 6 + [10, 11],
    [20, 21, 22, 23] * 5 + [20, 21],
    list(range(30, 60)) + list(range(30, 42)),
    [100, 101, 102, 103, 104, 105] * 3 + [7],
    [40, 41, 40, 42, 40, 43, 40, 41],
    [200, 201, 202] * 8,
]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv")
    make_tiny_directory(path, "llama", seed=1)
    return path


@pytest.fixture(scope="module")
def plain_outputs(model_dir) -> list[list[int]]:
    return plain_greedy_outputs(model_dir, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def engine(model_dir):
    with tiny_engine(model_dir, **ngram_args(8), max_total_tokens=4096, max_running_requests=8) as engine:
        yield engine


class AbortSpy:
    """Records the request ids the core really aborted (live requests only)."""

    def __init__(self, core):
        self.aborted: list[str] = []
        original = core.abort

        def abort(rid):
            req = original(rid)
            if req is not None:
                self.aborted.append(rid)
            return req

        core.abort = abort


# ---- how requests end ----
def test_normal_finish_frees_every_slot(engine, plain_outputs):
    first = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in first] == plain_outputs
    wait_until_all_kv_is_free(engine)
    # again, ending in every way: the trie now knows the outputs, so paths of many tokens get accepted
    stop_token = next(t for i, t in enumerate(plain_outputs[0]) if i >= 12 and t not in plain_outputs[0][:i])
    params = [
        GREEDY,
        {**GREEDY, "stop_token_ids": [stop_token]},                       # a stop inside an accepted path
        {**GREEDY, "max_new_tokens": 1},
        {**GREEDY, "max_new_tokens": 0},
        {**GREEDY, "stop_token_ids": [plain_outputs[0][2]], "min_new_tokens": 20},
        {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "seed": 3},
        {"temperature": 0.7, "top_k": 5, "max_new_tokens": 33, "ignore_eos": True, "seed": 4},
    ]
    second = engine.generate(input_ids=[PROMPTS[0]] * len(params), sampling_params=params)
    assert second[0]["output_ids"] == plain_outputs[0]
    assert max(second[0]["meta_info"]["spec_accept_histogram"]) >= 4
    cut = second[1]
    assert cut["output_ids"][-1] == stop_token and cut["meta_info"]["finish_reason"]["type"] == "stop"
    assert truncated_mid_path(cut), cut["meta_info"]
    assert [len(o["output_ids"]) for o in second[2:4]] == [1, 0]
    assert len(second[4]["output_ids"]) >= 20
    assert [len(o["output_ids"]) for o in second[5:]] == [40, 33]
    wait_until_all_kv_is_free(engine)


def test_abort_mid_stream_frees_every_slot(engine):
    spy = AbortSpy(engine.core)
    stream = engine.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 480},
                             stream=True, rid="stream-victim")
    received = 0
    for chunk in stream:
        received += len(chunk["output_ids"])
        if received >= 5:
            break
    stream.close()      # what dropping the iterator does: the generator's cleanup aborts the request
    wait_until_all_kv_is_free(engine)
    assert spy.aborted == ["stream-victim"]


def test_abort_request_frees_every_slot_and_spares_the_others(engine, plain_outputs):
    spy = AbortSpy(engine.core)
    result = {}
    others = [0, 2, 3]

    def run():
        result["victim"] = engine.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 480},
                                           rid="victim")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(getattr(engine.core.requests.get("victim"), "output_ids", ())) < 5:
        assert time.monotonic() < deadline, "the victim never started"
        time.sleep(0.005)
    rest = {}
    side = threading.Thread(target=lambda: rest.update(out=engine.generate(
        input_ids=[PROMPTS[i] for i in others], sampling_params=GREEDY)), daemon=True)
    side.start()
    time.sleep(0.05)
    engine.abort_request("victim")
    thread.join(timeout=60)
    side.join(timeout=60)
    assert not thread.is_alive() and not side.is_alive()
    assert result["victim"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 5 <= len(result["victim"]["output_ids"]) < 480
    assert spy.aborted == ["victim"]
    assert [o["output_ids"] for o in rest["out"]] == [plain_outputs[i] for i in others]
    wait_until_all_kv_is_free(engine)


def test_preemption_frees_every_slot(model_dir, plain_outputs):
    # 160 cache tokens cannot hold six requests of 24-42 + 40 tokens; each one alone fits
    with tiny_engine(model_dir, **ngram_args(8), max_total_tokens=160) as engine:
        for _ in range(2):
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == plain_outputs
            assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
            wait_until_all_kv_is_free(engine)


def test_abort_while_preempted_or_queued_frees_every_slot(model_dir, plain_outputs):
    """Aborts that land while a request waits: never admitted (max_running_requests), or
    preempted with output (its slots were freed once already: they must not be freed again)."""
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    with tiny_engine(model_dir, **ngram_args(8), max_total_tokens=160, max_running_requests=3) as engine:
        spy = AbortSpy(engine.core)
        result = {}
        thread = threading.Thread(target=lambda: result.update(out=engine.generate(
            input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 100}, rid=rids)), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while rids[-1] not in engine.core.requests:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        engine.abort_request(rids[-1])                  # behind three running requests
        preempted = []

        def abort_once_preempted(req):                 # on the core's thread, inside a step: the abort
            if not preempted and req.output_ids:       # is read before the next one, while req waits
                preempted.append(req.rid)
                engine.abort_request(req.rid)
        engine.core.scheduler.preempt_listeners.append(abort_once_preempted)
        thread.join(timeout=60)
        assert not thread.is_alive()
        wait_until_all_kv_is_free(engine)
    assert preempted, "no request was preempted"
    assert sorted(spy.aborted) == sorted([rids[-1], *preempted])
    for rid, out, want in zip(rids, result["out"], plain_outputs):
        if rid in spy.aborted:
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
        else:
            assert out["output_ids"][:40] == want and len(out["output_ids"]) == 100


def test_drafts_that_do_not_fit_are_cut_to_the_room_left(model_dir, plain_outputs, monkeypatch):
    """Drafts never outgrow a request's remaining max_new_tokens, so they only fail to fit while
    a cache too small for every request to finish at once has no preemption to do: here a
    long-prompt request with 6 new tokens shares the cache with one of 40 (each fits alone, both
    at once only with their trees cut); once the short one ends, the long one drafts in full."""
    cuts = []

    def fit(num_nodes, free):
        fitted = fit_to_free_slots(num_nodes, free)
        cuts.append(fitted != num_nodes)
        assert sum(fitted) <= free
        return fitted
    monkeypatch.setattr(specserve.engine.verify_step, "fit_to_free_slots", fit)
    short, long_ = PROMPTS[2], PROMPTS[0]
    params = [{**GREEDY, "max_new_tokens": 6}, GREEDY]
    with tiny_engine(model_dir, **ngram_args(16), max_total_tokens=len(short) + len(long_) + 12) as engine:
        allocs = AllocSpy(engine.core.scheduler)
        for _ in range(2):
            outputs = engine.generate(input_ids=[short, long_], sampling_params=params)
            assert [o["output_ids"] for o in outputs] == [plain_outputs[2][:6], plain_outputs[0]]
            assert sum(o["meta_info"]["preemptions"] for o in outputs) == 0
            wait_until_all_kv_is_free(engine)
        assert any(cuts) and allocs.refused == 0
        assert max(outputs[1]["meta_info"]["spec_accept_histogram"]) > 1     # drafts again once it fits


def test_drafts_stop_at_the_context_length(model_dir, plain_outputs):
    """A request that runs into the context length with 16-node drafts: no draft position past
    the context (req_to_token has context_length columns), same output, nothing leaked."""
    prompt = PROMPTS[2]                          # 42 tokens: 22 new ones fill a 64-token context
    with tiny_engine(model_dir, **ngram_args(16), context_length=64) as engine:
        for _ in range(2):
            out = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 100})
            assert out["output_ids"] == plain_outputs[2][:64 - len(prompt)]
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 64 - len(prompt)}
            wait_until_all_kv_is_free(engine)
        assert max(out["meta_info"]["spec_accept_histogram"]) > 4


# ---- NgramDrafter.propose ----
def fake_req(rid: str, prompt: list[int], output: list[int] | None = None):
    return SimpleNamespace(rid=rid, prompt_ids=list(prompt), output_ids=list(output or []))


def check_trees(trees, num_nodes: list[int], reqs, limits: list[int], one_branch: bool) -> list[tuple[list[int], list[int]]]:
    """Validity and conventions; returns each request's (tokens, parents) of its real nodes."""
    trees = trees.trees()
    trees.validate()
    assert trees.num_nodes.tolist() == num_nodes
    assert trees.num_slots == max(num_nodes)
    rows = []
    for b, (req, limit, count) in enumerate(zip(reqs, limits, num_nodes)):
        assert 1 <= count <= max(1, limit)
        tokens, parents = trees.tokens[b].tolist(), trees.parents[b].tolist()
        assert tokens[0] == (req.prompt_ids + req.output_ids)[-1]            # the root is the last token
        assert parents[0] == -1 and all(p == -1 for p in parents[count:])     # padding hangs off nothing
        assert all(d == 0 for d in trees.depth[b, count:].tolist())
        if one_branch:
            assert parents[:count] == list(range(-1, count - 1))
        rows.append((tokens[:count], parents[:count]))
    return rows


def paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Every root-to-node token path."""
    out = []
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            path.append(tokens[at])
            at = parents[at]
        out.append(path[::-1])
    return out


def occurs_in(path: list[int], sequences: list[list[int]]) -> bool:
    return any(seq[i:i + len(path)] == path for seq in sequences for i in range(len(seq)))


@pytest.mark.parametrize("one_branch", [False, True])
def test_ngram_drafter_proposes_valid_trees(one_branch):
    drafter = NgramDrafter(NgramConfig(max_bfs_breadth=4), one_branch=one_branch)
    code = [10, 11, 12, 13, 14, 10, 11, 12, 15, 16, 10, 11, 12, 13, 17]
    reqs = [fake_req("a", [99, 98, 10, 11]), fake_req("b", [50, 51, 52], [53, 10, 11]),
            fake_req("c", [90, 91]), fake_req("d", code, [10])]
    for req in reqs:
        drafter.add_prompt(req)
    drafter.observe(reqs[1], [53, 10, 11])
    drafter.flush()                              # as the engine does once the forward is launched
    limits = [8, 3, 5, 1]
    trees, num_nodes = drafter.propose(reqs, limits)
    rows = check_trees(trees, num_nodes, reqs, limits, one_branch)
    # only the suffix "10 11" was seen continued: always by 12, then by 13 (twice) or 15 (once)
    assert rows[0][0][:3] == [11, 12, 13]
    if not one_branch:
        children_of_12 = {t for t, p in zip(*rows[0]) if p == 1}
        assert children_of_12 == {13, 15}
    assert rows[1][0] == [11, 12, 13]
    assert num_nodes[2] == 1                     # 91 was never followed by anything: root only
    assert num_nodes[3] == 1                     # limit 1: root only
    known = [r.prompt_ids + r.output_ids for r in reqs]
    for tokens, parents in rows:
        for path in paths(tokens, parents):
            assert occurs_in(path, known), path           # every draft path continues a seen n-gram
    for req in reqs:
        drafter.release(req)
    assert drafter._owners == {}


@pytest.mark.parametrize("one_branch", [False, True])
def test_ngram_drafter_random_histories_stay_within_limits(one_branch):
    rng = random.Random(5)
    drafter = NgramDrafter(NgramConfig(max_bfs_breadth=3, max_trie_depth=8), one_branch=one_branch)
    reqs = []
    for i in range(12):
        motif = [rng.randrange(20) for _ in range(rng.randrange(2, 6))]
        prompt = (motif * 6)[:rng.randrange(3, 30)]
        req = fake_req(f"r{i}", prompt)
        drafter.add_prompt(req)
        reqs.append(req)
    for step in range(6):
        drafter.flush()
        limits = [rng.choice([1, 2, 4, 8, 16]) for _ in reqs]
        trees, num_nodes = drafter.propose(reqs, limits)
        rows = check_trees(trees, num_nodes, reqs, limits, one_branch)
        assert any(len(tokens) > 1 for tokens, _ in rows)
        for req, (tokens, parents) in zip(reqs, rows):
            # commit the first-child chain plus one new token, as a verify step would
            chain, node = [], 0
            while node in parents:
                node = parents.index(node)
                chain.append(tokens[node])
            committed = chain[:rng.randrange(len(chain) + 1)] + [rng.randrange(20)]
            req.output_ids.extend(committed)
            drafter.observe(req, committed)


def test_ngram_drafter_indexes_prompts_and_outputs_at_flush():
    """add_prompt and observe only queue tokens; flush (run while the GPU computes) hands them
    to the trie's writer, and a proposal sees what was flushed before it."""
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    writer, reader = fake_req("w", [5, 6, 7, 8]), fake_req("r", [40, 5, 6])
    drafter.add_prompt(writer)
    assert drafter.propose([reader], [4])[1] == [1]          # nothing indexed yet: root only
    drafter.flush()
    trees, num_nodes = drafter.propose([reader], [4])
    assert trees.tokens[0, :num_nodes[0]].tolist() == [6, 7, 8]
    writer.output_ids.extend([9, 10])
    drafter.observe(writer, [9, 10])
    assert drafter.propose([reader], [8])[1] == [3]
    drafter.flush()
    assert drafter.propose([reader], [8])[1] == [5]          # 6 -> 7 8 9 10
    drafter.release(writer)
    drafter.release(reader)


def test_ngram_tokens_queued_over_steps_are_indexed_in_one_call_per_request():
    """Plain steps that do not probe leave the flush to the next probe: a request's tokens
    of those steps reach the trie in one insert, in order, and (no two continuations tie
    here) the trie proposes what it does when they are indexed step by step."""
    stepwise, deferred = (NgramDrafter(NgramConfig(), one_branch=False) for _ in range(2))
    a, b = fake_req("a", [5, 6, 7]), fake_req("b", [20, 21])
    steps = [([8, 9], [22]), ([5], [23]), ([6, 7], [20, 21]), ([8, 10], [22])]
    inserts = []
    insert_many = deferred.trie.insert_many
    deferred.trie.insert_many = lambda streams: (inserts.extend((o, list(t)) for o, t in streams), insert_many(streams))
    for drafter in (stepwise, deferred):
        for req in (a, b):
            drafter.add_prompt(req)
        for tokens_a, tokens_b in steps:
            drafter.observe(a, tokens_a)
            drafter.observe(b, tokens_b)
            if drafter is stepwise:
                drafter.flush()
        drafter.flush()
        drafter.writer.drain()   # the writer thread's inserts are done
    owner_a, owner_b = deferred._owners["a"], deferred._owners["b"]
    assert inserts == [(owner_a, [5, 6, 7, 8, 9, 5, 6, 7, 8, 10]), (owner_b, [20, 21, 22, 23, 20, 21, 22])]
    a.output_ids, b.output_ids = [8, 9, 5, 6, 7, 8, 10], [22, 23, 20, 21, 22]
    reader = fake_req("r", [1, 5, 6, 7])
    for req, limit in ((a, 8), (b, 8), (reader, 8)):
        got = [drafter.propose([req], [limit]) for drafter in (stepwise, deferred)]
        assert got[0][1] == got[1][1]
        assert got[0][0].tokens.tolist() == got[1][0].tokens.tolist()
        assert got[0][0].parents.tolist() == got[1][0].parents.tolist()
