"""Hybrid drafting (--speculative-hybrid-ngram, speculative/hybrid/): an EAGLE-3 head and the
n-gram trie, each request's step drafted by whichever is measured to commit more.

Greedy output is plain decoding's with the prefix cache on and off (head chains and EAGLE-2
trees, every step drafting or under the adaptive policy), and every target and head slot is
free or cached afterwards; the trie drafts where the text repeats and the head where the trie
has nothing; seeded sampling gives plain decoding's tokens; sampled output follows the
target's distribution (chi-square) with both sources drafting in the same steps; flags
outside EAGLE / EAGLE3 are refused naming the field. Random tiny targets and heads.
"""
from __future__ import annotations

import asyncio
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specserve.args import ServerArgs
from specserve.engine.draft_ahead import ForecastStep
from specserve.errors import ArgumentError
from specserve.speculative.hybrid import source_choice
from specserve.speculative.hybrid.drafter import HybridDrafter, merge_proposals
from specserve.speculative.hybrid.fused_hybrid import FusedHybridDrafter
from specserve.speculative.hybrid.run_rates import RunRates
from specserve.speculative.hybrid.source_choice import HEAD_RECHECK_STEPS, SourceChoice
from specserve.speculative.hybrid.step_prices import CHAINED, RESTART, TRIE, StepPrices
from specserve.training.target_features import TargetFeatureExtractor
from specserve.verify.tree import TreeProposal
from tests.fused_fixtures import FusedSpy, save_random_eagle_head
from tests.spec_fixtures import (assert_draft_pool_is_free, cached_draft_rows, make_tiny_directory, tiny_engine,
                                 wait_until_all_kv_is_free)
from tests.test_draft_ahead import ahead_on
from tests.test_spec_sampling import (ALPHA, MAX_NEW_TOKENS, PROMPT, VOCAB, chi_square_p, exact_joint,
                                      exact_step_logits)

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11, "max_new_tokens": 32, "ignore_eos": True}
REPEATING = [20, 21, 22, 23] * 5          # the target's answer to it falls into a loop (92, 245, 92, ...)
DISTINCT = list(range(30, 72))            # ... and to this one starts with tokens the prompt lacks
PROMPTS = [[5, 6, 7, 8, 9] * 6 + [10, 11], REPEATING, DISTINCT, [100, 101] * 9]
FOLLOW_UP = [3, 4, 5, 6]
SHAPES = {"chain": {"speculative_num_steps": 3},
          "tree": {"speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}}


MEASURED_COMMIT = StepPrices.committed


@pytest.fixture(autouse=True)
def unpriced_steps(monkeypatch):
    """The engines here choose between the sources as before any step is priced: prices are
    wall times, which on a shared CPU move from run to run, and the choice with them
    (test_an_engine_prices_its_steps restores them; the rule under prices is tested alone)."""
    monkeypatch.setattr(StepPrices, "committed", lambda self, rids, root, now: None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, head): a random 256-token target of HF's initialisation (its greedy answers
    repeat themselves after a while), a random EAGLE-3 head over its even tokens."""
    root = tmp_path_factory.mktemp("hybrid")
    make_tiny_directory(root / "target", "llama", seed=1, weight_std=None)
    save_random_eagle_head(root / "target", root / "head", algorithm="EAGLE3", draft_vocab=torch.arange(0, 256, 2))
    return root / "target", root / "head"


def hybrid_args(head, shape: str = "chain", adaptive: bool = False, **extra) -> dict:
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head),
            "speculative_hybrid_ngram": True, "speculative_disable_adaptive": not adaptive, **SHAPES[shape], **extra}


def two_turns(engine, params: dict) -> list[dict]:
    first = engine.generate(input_ids=PROMPTS, sampling_params=params)
    seconds = [p + o["output_ids"] + FOLLOW_UP for p, o in zip(PROMPTS, first)]
    return first + engine.generate(input_ids=seconds, sampling_params=params)


def sources(outputs: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for out in outputs:
        for source, count in out["meta_info"].get("spec_draft_sources", {}).items():
            total[source] = total.get(source, 0) + count
    return total


def wait_until_everything_is_free(engine) -> None:
    """Every target slot and every head slot is free or the prefix cache's, exactly once."""
    wait_until_all_kv_is_free(engine)
    head = engine.core.drafter.head
    assert not head.kv.sequences and head.states.held_rows == 0
    assert_draft_pool_is_free(head.kv.pool, cached_draft_rows(engine))


@pytest.fixture(scope="module")
def plain(models):
    with tiny_engine(models[0]) as engine:
        return {"greedy": [o["output_ids"] for o in two_turns(engine, GREEDY)],
                "seeded": [o["output_ids"] for o in two_turns(engine, SEEDED)]}


@pytest.mark.parametrize("shape, adaptive", [("chain", False), ("tree", False), ("chain", True)],
                         ids=["chain", "tree", "chain-adaptive"])
@pytest.mark.parametrize("disable_radix_cache", [False, True], ids=["cached", "uncached"])
def test_greedy_output_is_plain_decodings(models, plain, shape, adaptive, disable_radix_cache, monkeypatch):
    """(Under the adaptive policy the random head drafts seldom: the trie's drafts are taken
    wherever they beat it, so that both sources draft in this short run.)"""
    if adaptive:
        monkeypatch.setattr(source_choice, "BREAK_GAIN", 0.0)
    target, head = models
    with tiny_engine(target, **hybrid_args(head, shape, adaptive), disable_radix_cache=disable_radix_cache) as engine:
        keys = set()
        if adaptive:   # as on a GPU: steps launched ahead
            ahead_on(engine)
            record = engine.core.adaptive.record_proposals

            def recorded(rids, trees, num_nodes, proposal_keys=None):
                keys.update(key for key, nodes in zip(proposal_keys, num_nodes) if nodes > 1)
                return record(rids, trees, num_nodes, proposal_keys)
            engine.core.adaptive.record_proposals = recorded
        outputs = two_turns(engine, GREEDY)
        assert [o["output_ids"] for o in outputs] == plain["greedy"]
        used = sources(outputs)
        assert used.get("ngram", 0) > 0 and used.get("head", 0) > 0, used
        assert used == engine.core.drafter.proposals
        if not disable_radix_cache:
            assert min(o["meta_info"]["cached_tokens"] for o in outputs[len(PROMPTS):]) > 0
        if adaptive:   # the policy prices the sources apart: trie drafts by class (match length), head drafts per request
            assert None in keys and any(key is not None for key in keys), keys
        wait_until_everything_is_free(engine)


def test_head_steps_are_fused_and_chained_beside_trie_steps(models, plain):
    """A chain head's steps are the fused chain's (fused_hybrid.py), launched before the step
    they follow is read where the batch stays the same, as on a GPU; trie steps, verified by
    the engine, break the chain; the output is plain decoding's and everything is freed."""
    target, head = models
    with tiny_engine(target, **hybrid_args(head)) as engine:
        ahead_on(engine)
        drafter = engine.core.drafter
        assert isinstance(drafter, FusedHybridDrafter)
        spy = FusedSpy(drafter.head)
        outputs = two_turns(engine, GREEDY)
        assert [o["output_ids"] for o in outputs] == plain["greedy"]
        used = sources(outputs)
        assert used.get("ngram", 0) > 0 and used.get("head", 0) > 0, used
        assert spy.fused > 0 and spy.chained > 0 and spy.engine > 0, vars(spy)
        wait_until_everything_is_free(engine)


def observed_states(engine) -> dict[tuple, torch.Tensor]:
    """Spies on the target's states the hybrid is given: (prompt, position) -> state."""
    drafter, states = engine.core.drafter, {}
    observe = drafter.observe_hidden

    def observing(reqs, starts, given, rows, owned=False):
        for req, start, request_rows in zip(reqs, starts, rows):
            for offset, row in enumerate(request_rows):
                states[(tuple(req.prompt_ids), start + offset)] = given[row].clone()
        return observe(reqs, starts, given, rows, owned)
    drafter.observe_hidden = observing
    return states


def test_trie_steps_are_forecast_and_give_the_head_their_states(models, plain, monkeypatch):
    target, head = models
    with tiny_engine(target, **hybrid_args(head, speculative_ngram_forecast=2)) as engine:
        check_forecast_steps(ahead_on(engine), plain["greedy"], monkeypatch, tolerance=1e-4)


def check_forecast_steps(engine, plain_greedy: list[list[int]], monkeypatch, tolerance: float) -> None:
    """With --speculative-ngram-forecast (on by default on a GPU), a batch whose every request
    drafts from the trie queues its next trie step before this one is read, its drafts picked
    from the trie's forecast (engine/draft_ahead.py); the output is plain decoding's, those
    drafts count as the trie's, and the head is given the target's states of the tokens those
    steps commit (a forecast step's rows, cut where a request ended; on a GPU, a graph's
    outputs the next replay overwrites): those of one forward over the whole sequence."""
    held, forecast_positions = [], set()
    hold = ForecastStep.hold

    def holding(self, *args):
        held_step = hold(self, *args)
        held.append(held_step[0])   # its accepted nodes' states are observed from each request's kv_len on
        forecast_positions.update((tuple(req.prompt_ids), req.kv_len) for req in held_step[0].reqs)
        return held_step
    monkeypatch.setattr(ForecastStep, "hold", holding)
    states = observed_states(engine)
    outputs = two_turns(engine, GREEDY)
    assert [o["output_ids"] for o in outputs] == plain_greedy
    # requests that end at different steps, some while the step after theirs is forecast already
    # (every step forecast: the gate's record of the runs above says it does not pay here)
    gate = engine.core.drafting.forecast_gate
    wants = gate.wants
    gate.wants = lambda records, batch_size: (True, wants(records, batch_size)[1])
    lengths = [13, 19, 25, 31]
    ending = engine.generate(input_ids=PROMPTS, sampling_params=[{**GREEDY, "max_new_tokens": n} for n in lengths])
    assert [o["output_ids"] for o in ending] == [a[:n] for a, n in zip(plain_greedy, lengths)]
    used = sources(outputs + ending)
    assert used.get("ngram", 0) > 0 and used.get("head", 0) > 0, used
    assert used == engine.core.drafter.proposals
    assert any(len(step.reqs) > 1 for step in held), [len(step.reqs) for step in held]
    assert any(step.rows is not None for step in held)
    assert forecast_positions <= states.keys()
    runner = engine.core.runner
    extract = TargetFeatureExtractor(runner.model, runner.hidden_capture.layers, max_tokens=256, max_sequences=1)
    checked = 0
    for prompt, output in zip(PROMPTS + [p + o + FOLLOW_UP for p, o in zip(PROMPTS, plain_greedy)], plain_greedy):
        positions = sorted(p for key, p in forecast_positions if key == tuple(prompt))
        if positions:
            want = extract([list(prompt) + output]).layers
            for position in positions:
                torch.testing.assert_close(states[(tuple(prompt), position)], want[position],
                                           atol=tolerance, rtol=tolerance)
            checked += len(positions)
    assert checked == len(forecast_positions) > 0
    wait_until_everything_is_free(engine)


def test_a_forecast_is_asked_only_while_every_request_drafts_from_the_trie():
    """... and none is due to take the head's drafts at its next step (HEAD_RECHECK_STEPS)."""
    ngram = SimpleNamespace(forecasts=lambda batch_size: True)
    drafter = HybridDrafter(ngram, SimpleNamespace(num_steps=3), max_nodes=8)
    assert not drafter.forecasts(2)
    reqs = [SimpleNamespace(rid=rid, last_token=7, num_tokens=10, spec=SimpleNamespace(draft_sources={})) for rid in "ab"]
    trie = TreeProposal.from_lists([([7, 1, 2], [-1, 0, 1])] * 2)
    for streak in range(1, HEAD_RECHECK_STEPS + 1):
        drafter.forecast_held(reqs, trie, [3, 3], [2, 2])
        assert drafter.forecasts(2) == (streak < HEAD_RECHECK_STEPS)
        assert drafter.proposals["ngram"] == 2 * streak
    drafter.choice.took(["a"], np.zeros(1, dtype=bool))   # a step of the head's for one of them
    drafter._trie_only = drafter.choice.trie_may_go_on(["a", "b"])
    assert not drafter.forecasts(2)


def test_a_fused_head_gives_way_only_to_trie_drafts_worth_the_break():
    """Where the head's steps are fused, the batch takes trie drafts only where they are
    expected to commit more than the head's by the excess its steps cost (in head tokens);
    beside an unfused head (trees), wherever they beat it."""
    choice = SourceChoice(8, head_depth=3)
    trie = TreeProposal.from_lists([([0, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 3, 4])] * 2)
    head = TreeProposal.from_lists([([0, 1, 8, 9], [-1, 0, 1, 2])] * 2)
    for _ in range(20):   # the trie's class 2 commits 5 tokens, the head 2
        choice.record(["a", "b"], trie, [6, 6], [2, 2], head, [4, 4])
        choice.observe_batch(["a", "b"], [[1, 2, 3, 4, 6], [1, 2, 3, 4, 6]])
    assert choice.expected_from_trie(2) == pytest.approx(5, abs=0.01)
    assert choice.expected_from_head("a") == pytest.approx(2, abs=0.01)
    # one request's gain (3 tokens) is less than the batch's head tokens (4) times an excess of 1; two requests' is more
    assert choice.choose(["a", "b"], [6, 1], [2, 0], excess=None).tolist() == [True, False]
    assert choice.choose(["a", "b"], [6, 1], [2, 0], excess=1.0).tolist() == [False, False]
    assert not choice.breaks_chain(["a", "b"], [6, 1], [2, 0], 1.0)
    assert choice.choose(["a", "b"], [6, 6], [2, 2], excess=1.0).tolist() == [True, True]
    assert choice.breaks_chain(["a", "b"], [6, 6], [2, 2], 1.0)
    # a cheaper trie step (an excess of 0.5: 2 tokens) lets the lone request's 3 through; a dearer one stops both
    assert choice.choose(["a", "b"], [6, 1], [2, 0], excess=0.5).tolist() == [True, False]
    assert not choice.breaks_chain(["a", "b"], [6, 6], [2, 2], 2.0)
    # beside trie drafts, a request without pending head drafts verifies its root alone: its head tokens but one are lost
    assert choice.choose(["a", "b"], [6, 1], [2, 0], 0.6, np.array([True, True])).tolist() == [True, False]
    assert choice.choose(["a", "b"], [6, 1], [2, 0], 0.6, np.array([True, False])).tolist() == [False, False]
    # what an instrument hears of each choice (bench/policy_trace.py)
    heard = []
    choice.listener = heard.append
    choice.choose(["a", "b"], [6, 1], [2, 0], excess=1.0)
    choice.breaks_chain(["a", "b"], [6, 6], [2, 2], 1.25)
    assert [{k: e[k] for k in ("kind", "with_trie", "preferred", "taken", "excess")} for e in heard] == [
        {"kind": "choose", "with_trie": 1, "preferred": 1, "taken": 0, "excess": 1.0},
        {"kind": "counterfactual", "with_trie": 2, "preferred": 2, "taken": True, "excess": 1.25}]
    assert [(e["trie_gain"], e["head_tokens"]) for e in heard] == [(pytest.approx(3, abs=0.05), pytest.approx(4, abs=0.05)),
                                                                  (pytest.approx(6, abs=0.05), pytest.approx(4, abs=0.05))]


def test_a_requests_trie_expectations_follow_what_its_contending_drafts_commit():
    """The trie's classes are measured over every request; a request whose contending trie drafts
    (those its class expects to beat the head with) commit less than their class promised has its
    expectations scaled down, one whose drafts commit more, up (trie_calibration.py)."""
    choice = SourceChoice(8, head_depth=3)
    trie = TreeProposal.from_lists([([0, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 3, 4])] * 3)
    head = TreeProposal.from_lists([([0, 1, 8, 9], [-1, 0, 1, 2])] * 3)
    for _ in range(30):   # the class: "a" commits 2 of its drafts' tokens, "b" 5, "c" has no draft
        choice.record(["a", "b", "c"], trie, [6, 6, 1], [2, 2, 0], head, [4, 4, 4])
        choice.observe_batch(["a", "b", "c"], [[1, 7], [1, 2, 3, 4, 6], [1, 7]])
    assert choice.expected_from_trie(2) == pytest.approx(3.5, abs=0.05)   # the class, over both
    assert choice.expected_from_trie(2, "a") == pytest.approx(2, abs=0.05)
    assert choice.expected_from_trie(2, "b") == pytest.approx(5, abs=0.05)
    assert choice.expected_from_trie(2, "c") == pytest.approx(3.5, abs=0.05)   # no drafts of its own: the class
    assert choice.expected_from_head("a") == choice.expected_from_head("b") == pytest.approx(2, abs=0.01)
    assert choice.choose(["a", "b"], [6, 6], [2, 2]).tolist() == [False, True]
    choice.release("a")
    assert choice.expected_from_trie(2, "a") == pytest.approx(3.5, abs=0.05)


def test_one_walk_moves_a_requests_trie_calibration_a_step_from_its_class():
    """A request's calibration starts at its class's promise: a first walk that committed 3 of
    the 12 tokens expected moves the factor by ACCEPT_EMA of the miss, not to 3 / 12."""
    from specserve.speculative.adaptive.acceptance import ACCEPT_EMA, Shadow
    from specserve.speculative.hybrid.trie_calibration import TrieCalibration
    calibration = TrieCalibration(16)

    def walked_three_of_twelve():
        shadow = Shadow({}, set(), key=2)
        shadow.path, shadow.ended = [1, 2], True   # two drafted tokens matched: 3 committed
        calibration.note("a", shadow, expected=12.0)
        calibration.update(["a"])
    assert calibration.factor("a") == 1.0
    walked_three_of_twelve()
    assert calibration.factor("a") == pytest.approx((12 + ACCEPT_EMA * (3 - 12)) / 12)
    for _ in range(40):
        walked_three_of_twelve()
    assert calibration.factor("a") == pytest.approx(0.25, abs=0.01)


def test_steps_are_priced_by_kind_from_commit_to_commit(monkeypatch):
    """A step's price is the time from the commit before it, no prefill between, found by its
    first request's root; a proposal that never ran is passed over; a kind is priced from its
    second step at a bucket on, at the cheaper of its first two (the first is often a stall),
    then at the median; the excesses follow."""
    monkeypatch.setattr(StepPrices, "committed", MEASURED_COMMIT)
    prices = StepPrices()
    assert prices.break_excess(1) is None and prices.stay_excess(1) is None
    prices.committed(["a"], 9, now=0.0)                  # a plain step: nothing proposed at 9
    now, root = 0.0, 10

    def step(kind: str, seconds: float, rids=("a",)) -> None:
        nonlocal now, root
        now += seconds
        prices.proposed("a", root, kind)
        prices.committed(list(rids), root, now)
        root += 4
    step(CHAINED, 0.002), step(TRIE, 0.272), step(RESTART, 0.004)   # the first trie step a stall (a compile)
    assert prices.price(TRIE, 1) is None and prices.price(RESTART, 1) is None and prices.price(CHAINED, 1) is None
    assert prices.break_excess(1) is None
    step(CHAINED, 0.002), step(TRIE, 0.0027), step(RESTART, 0.004), step(CHAINED, 0.002)
    assert prices.price(CHAINED, 1) == pytest.approx(0.002)
    assert prices.price(TRIE, 1) == pytest.approx(0.0027)   # the cheaper of 272 and 2.7 ms
    assert prices.price(RESTART, 1) == pytest.approx(0.004)
    # a trie step and its restart (6.7 ms) against two chained steps (4 ms), in chained steps
    assert prices.break_excess(1) == pytest.approx(1.35)
    assert prices.stay_excess(1) == pytest.approx(0.35)
    assert prices.price(CHAINED, 64) is None             # per batch bucket
    prices.proposed("a", root, TRIE)                     # looked at, never run
    root += 1
    step(CHAINED, 0.006)
    # a chained step of 6 ms, no trie step: the median of 2, 2, 2 and 6 ms
    assert prices.price(CHAINED, 1) == pytest.approx(0.002) and prices.price(TRIE, 1) == pytest.approx(0.0027)
    step(TRIE, 0.0031)                                   # a third trie step: the median of 272, 2.7 and 3.1 ms
    assert prices.price(TRIE, 1) == pytest.approx(0.0031)
    prices.prefilled()                                   # a prompt joined: its prefill is in the next interval
    step(TRIE, 0.0133, rids=("a", "b"))
    step(TRIE, 0.004, rids=("a", "b"))                   # the next steps are priced, at the batch's bucket
    assert prices.price(TRIE, 2) is None
    step(TRIE, 0.005, rids=("a", "b"))
    assert prices.price(TRIE, 2) == pytest.approx(0.004) and prices.price(TRIE, 1) == pytest.approx(0.0031)


def test_an_engine_prices_its_steps(models, monkeypatch):
    """Serving, the fused hybrid prices the kinds of step it runs at the batch's bucket (the
    trie's where the answer loops; the head's restarts where it drafts after a read)."""
    monkeypatch.setattr(StepPrices, "committed", MEASURED_COMMIT)
    target, head = models
    with tiny_engine(target, **hybrid_args(head)) as engine:
        engine.generate(input_ids=REPEATING, sampling_params={**GREEDY, "max_new_tokens": 64})
        prices = engine.core.drafter.prices
        assert prices.price(TRIE, 1) > 0 and prices.price(RESTART, 1) > 0
        assert prices.price(TRIE, 2) is None


def test_a_fused_hybrid_weighs_trie_drafts_by_the_prices_it_measured(monkeypatch):
    """Once its steps are priced, a fused hybrid asks the trie's drafts for the measured excess:
    where the chain is broken, a trie step's beyond a chained one; at a chained step, a trie
    step's and its restart's beyond two chained ones; before that, UNPRICED_EXCESS."""
    ngram = SimpleNamespace(propose=lambda reqs, max_nodes: (TreeProposal.root_only([0] * len(reqs)), [1] * len(reqs)),
                            proposal_keys=lambda: [0])
    head = SimpleNamespace(num_steps=3, chained_proposal=lambda reqs: (TreeProposal.root_only([0]), [1]),
                           holds_chain=lambda req: req.rid == "a")
    monkeypatch.setattr(StepPrices, "committed", MEASURED_COMMIT)
    hybrid = FusedHybridDrafter(ngram, head, 8)
    asked = []
    hybrid.choice.breaks_chain = lambda rids, nodes, keys, excess: asked.append(excess) or False
    req = SimpleNamespace(rid="a", num_tokens=10, last_token=0, spec=SimpleNamespace(draft_sources={}))
    excess, ready = hybrid._trie_price([req, SimpleNamespace(rid="b")])
    assert excess == source_choice.UNPRICED_EXCESS and ready.tolist() == [True, False]
    hybrid.chained_proposal([req])
    assert asked == [source_choice.UNPRICED_EXCESS]
    now = 0.0
    hybrid.prices.committed(["a"], 10, now)   # the chained step proposed above
    steps = ((CHAINED, 0.002), (TRIE, 0.005), (RESTART, 0.006)) * 2   # each kind priced from its second step
    for root, (kind, seconds) in enumerate(steps, start=11):
        now += seconds
        hybrid.prices.proposed("a", root, kind)
        hybrid.prices.committed(["a"], root, now)
    assert hybrid._trie_price([req])[0] == pytest.approx(1.5)    # (5 - 2) / 2
    hybrid.chained_proposal([req])
    assert asked[-1] == pytest.approx(3.5)                     # (5 + 6 - 4) / 2


def test_a_large_batch_s_counterfactual_looks_at_a_window_moving_through_it():
    """A chained step of 40 requests: the trie proposes for COUNTERFACTUAL_REQUESTS of them, a
    window that moves on by that many each step (wrapping), and only they are asked whether
    breaking the chain would pay and recorded as shadows (both sources'); every request keeps
    its head chain. A batch of 16 is looked at whole."""
    from specserve.speculative.hybrid.fused_hybrid import COUNTERFACTUAL_REQUESTS
    proposed, asked, recorded = [], [], []

    def ngram_propose(reqs, max_nodes):
        proposed.append([r.rid for r in reqs])
        return TreeProposal.root_only([0] * len(reqs)), [1] * len(reqs)

    def chains(reqs):
        return TreeProposal.from_lists([([0, 5, 6], [-1, 0, 1])] * len(reqs)), [3] * len(reqs)
    ngram = SimpleNamespace(propose=ngram_propose, proposal_keys=lambda: [0] * len(proposed[-1]))
    head = SimpleNamespace(num_steps=2, chained_proposal=chains)
    hybrid = FusedHybridDrafter(ngram, head, 8)
    hybrid.choice.breaks_chain = lambda rids, nodes, keys, excess: asked.append(rids) or False
    hybrid.choice.record = lambda rids, trie, trie_nodes, keys, head, head_nodes: recorded.append(
        (rids, head.batch_size, head_nodes))
    reqs = [SimpleNamespace(rid=str(i), num_tokens=10, last_token=0, spec=SimpleNamespace(draft_sources={}))
            for i in range(40)]
    for req in reqs:
        hybrid._seen[req.rid] = req.num_tokens
    window = COUNTERFACTUAL_REQUESTS
    for step in range(3):
        proposal, nodes = hybrid.chained_proposal(reqs)
        assert proposal.batch_size == 40 and nodes == [3] * 40 and hybrid.proposal_keys() == [None] * 40
        expected = [str((step * window + i) % 40) for i in range(window)]
        assert proposed[-1] == asked[-1] == recorded[-1][0] == expected
        assert recorded[-1][1:] == (window, [3] * window)
    hybrid.chained_proposal(reqs[:window])
    assert proposed[-1] == [r.rid for r in reqs[:window]]


def test_steps_off_the_chain_keep_the_output_and_free_everything(models, monkeypatch):
    """Where the head's runs are priced below any step off the chain (run_rates.py), a broken
    chain is not restarted: the trie drafts where it matches, and at batch 1 the roots alone
    run as plain steps launched ahead. The output is plain decoding's, one
    prompt at a time and four together, and every slot is freed."""
    monkeypatch.setattr(StepPrices, "committed", MEASURED_COMMIT)
    monkeypatch.setattr(RunRates, "head_rate", lambda self, batch_size: 1e-3)
    target, head = models
    with tiny_engine(target) as engine:
        expected = [[o["output_ids"] for o in engine.generate(input_ids=p, sampling_params=GREEDY)]
                    for p in ([PROMPTS[1]], [PROMPTS[2]], PROMPTS)]
    with tiny_engine(target, **hybrid_args(head)) as engine:
        ahead_on(engine)
        drafter, off = engine.core.drafter, []
        stay_off = drafter.choice.stay_off
        drafter.choice.stay_off = lambda rids, *args: off.append((len(rids), bool(args[2].any()))) or stay_off(rids, *args)
        plain_steps = engine.core.overlap.launch_ahead
        launched = []
        engine.core.overlap.launch_ahead = lambda reqs, **kw: launched.append(len(reqs)) or plain_steps(reqs, **kw)
        outputs = [[o["output_ids"] for o in engine.generate(input_ids=p, sampling_params=GREEDY)]
                   for p in ([PROMPTS[1]], [PROMPTS[2]], PROMPTS)]
        assert outputs == expected
        assert (1, True) in off and (1, False) in off and any(size == 4 for size, _ in off), off
        assert launched.count(1) > 0
        wait_until_everything_is_free(engine)


def test_a_small_cache_preempts_and_evicts_without_changing_the_output(models, plain):
    """A cache that holds one or two requests, prompts in chunks: requests are preempted (the
    head forgets them, the trie does not) and cached prefixes evicted with their head rows."""
    target, head = models
    with tiny_engine(target, **hybrid_args(head, "tree"), max_total_tokens=160, chunked_prefill_size=16) as engine:
        outputs = two_turns(engine, GREEDY)
        assert [o["output_ids"] for o in outputs] == plain["greedy"]
        assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
        wait_until_everything_is_free(engine)


@pytest.mark.parametrize("ahead", [False, True], ids=["read", "chained"])
def test_seeded_sampling_is_plain_decodings(models, plain, monkeypatch, ahead):
    """The coupled rule: a seeded request samples plain decoding's tokens, whichever source
    drafted (the trie's drafts taken wherever they are expected to beat the head's, chain or not),
    also with steps launched ahead, as on a GPU (the head's fused steps chained)."""
    monkeypatch.setattr(source_choice, "BREAK_GAIN", 0.0)
    target, head = models
    with tiny_engine(target, **hybrid_args(head)) as engine:
        if ahead:
            ahead_on(engine)
        spy = FusedSpy(engine.core.drafter.head)
        outputs = two_turns(engine, SEEDED)
        assert [o["output_ids"] for o in outputs] == plain["seeded"]
        assert len(sources(outputs)) == 2
        wait_until_everything_is_free(engine)
    assert (spy.chained > 0) == ahead, vars(spy)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_the_trie_drafts_where_the_text_repeats(models, ahead):
    """The answer falls into a loop after ~20 tokens: there the trie drafts, and its long drafts
    are accepted (a step commits more than the head's chain of 3 could), the random head's not.
    `ahead`: each step is proposed before the tokens of the one before are shown to the
    drafter, whose measures of both sources still walk each proposal from its own root."""
    target, head = models
    with tiny_engine(target, **hybrid_args(head)) as engine:
        if ahead:
            ahead_on(engine)
        out = engine.generate(input_ids=REPEATING, sampling_params={**GREEDY, "max_new_tokens": 128})
        used, histogram = out["meta_info"]["spec_draft_sources"], out["meta_info"]["spec_accept_histogram"]
        assert used["ngram"] >= 10, used
        assert sum(count for length, count in histogram.items() if length > 4) >= 8, histogram
        assert out["meta_info"]["spec_accept_length"] > 3.0


def test_the_head_drafts_where_the_trie_has_nothing(models):
    target, head = models
    with tiny_engine(target, **hybrid_args(head)) as engine:
        out = engine.generate(input_ids=DISTINCT, sampling_params={**GREEDY, "max_new_tokens": 8})
        used = out["meta_info"]["spec_draft_sources"]
        # every step drafted, the head's drafts, but the last (one token left: nothing to draft)
        assert list(used) == ["head"] and used["head"] == out["meta_info"]["spec_verify_ct"] - 1, used


def test_the_choice_follows_measured_acceptance():
    """A trie class that committed more than the head did for the request wins; the head
    wins where the class is unmeasured or there is no match, and rechecks after a streak."""
    choice = SourceChoice(4, head_depth=2)
    assert choice.expected_from_head("a") == 3.0                      # before any measure: every head draft accepted
    chain = TreeProposal.from_lists([([0, 1, 2, 3], [-1, 0, 1, 2])])
    choice.record(["a"], chain, [4], [5], TreeProposal.from_lists([([0, 7, 8], [-1, 0, 1])]), [3])
    assert choice.choose(["a"], [4], [5]).tolist() == [False]         # class 5 not measured yet
    choice.observe_batch(["a"], [[1, 2, 3, 9]])                        # the trie's chain all accepted, the head's none
    assert choice.expected_from_trie(5) > choice.expected_from_head("a")
    picks = [choice.choose(["a"], [4], [5])[0] for _ in range(HEAD_RECHECK_STEPS + 1)]
    assert picks == [True] * HEAD_RECHECK_STEPS + [False]
    assert choice.choose(["a"], [1], [5]).tolist() == [False]          # no match: the head
    assert choice.choose(["a"], [4], [2]).tolist() == [False]          # no class this short measured
    assert choice.expected_from_trie(6) == choice.expected_from_trie(5)   # a longer match borrows class 5's


def test_a_proposal_made_ahead_is_walked_from_its_own_root():
    """A step proposed before the tokens of the one before were observed (launched ahead, as on
    a GPU): its proposals join the choice's walks only after those tokens, so each is walked
    by the tokens committed after its own root."""
    def chain(tokens):
        return TreeProposal.from_lists([([0, *tokens], list(range(-1, len(tokens))))])

    trie = SimpleNamespace(next=None, proposal_keys=lambda: [3], observe_batch=lambda reqs, committed: None)
    trie.propose = lambda reqs, max_nodes: (trie.next, [4])
    head = SimpleNamespace(num_steps=3, propose=lambda reqs, max_nodes: (TreeProposal.root_only([0]), [1]),
                           observe_batch=lambda reqs, committed: None)
    hybrid = HybridDrafter(trie, head, 4)
    req = SimpleNamespace(rid="a", num_tokens=10, last_token=0, spec=SimpleNamespace(draft_sources={}))
    hybrid.observe_batch([req], [[0]])
    trie.next = chain([1, 2, 3])
    hybrid.propose([req], [4])                   # after the observe: walked from here
    req.num_tokens = 14
    trie.next = chain([5, 6, 7])
    hybrid.propose([req], [4])                   # ahead of the observe of the step before's tokens
    hybrid.observe_batch([req], [[1, 2, 3, 4]])
    req.num_tokens = 18
    hybrid.observe_batch([req], [[5, 6, 7, 8]])
    assert hybrid.choice.expected_from_trie(3) == 4.0   # both drafts wholly accepted, as they were


def test_proposals_merge_row_by_row():
    trie = TreeProposal.from_lists([([5, 1, 2, 3, 4], [-1, 0, 1, 2, 3]), ([6], [-1])])
    head = TreeProposal.from_lists([([5, 9], [-1, 0]), ([6, 7, 8], [-1, 0, 0])])
    merged = merge_proposals(trie, head, np.array([True, False]))
    assert merged.num_nodes.tolist() == [5, 3]
    assert merged.tokens.tolist() == [[5, 1, 2, 3, 4], [6, 7, 8, 0, 0]]
    assert merged.parents.tolist() == [[-1, 0, 1, 2, 3], [-1, 0, 0, -1, -1]]


def test_flags_outside_eagle_are_refused(models):
    target, head = models
    for algorithm in ("NGRAM", "LOOKAHEAD", "STANDALONE", "NAIVE_EAGLE", "MTP"):
        extra = {"speculative_draft_model_path": str(head)} if algorithm not in ("NGRAM", "LOOKAHEAD") else {}
        with pytest.raises(ArgumentError, match="speculative_hybrid_ngram.*EAGLE or EAGLE3"):
            ServerArgs(speculative_algorithm=algorithm, speculative_hybrid_ngram=True, **extra)
    with pytest.raises(ArgumentError, match="speculative_hybrid_ngram"):
        tiny_engine(target, speculative_algorithm="NGRAM", speculative_hybrid_ngram=True)
    with pytest.raises(ArgumentError, match="speculative_ngram_max_bfs_breadth"):   # the trie's settings are checked
        ServerArgs(**hybrid_args(head), speculative_ngram_min_bfs_breadth=4, speculative_ngram_max_bfs_breadth=2)
    # without speculation it idles, as every speculative setting does (--compare-plain's plain engine)
    assert ServerArgs(**hybrid_args(head)).replace(speculative_algorithm=None).speculative is None
    args = ServerArgs(**hybrid_args(head, speculative_num_draft_tokens=8))
    assert args.speculative_verify_size == 8 and args.speculative_one_branch is False
    # under the adaptive policy the trie beside a chain drafts as NGRAM's does: chains of up to 16 nodes
    args = ServerArgs(**hybrid_args(head, adaptive=True))
    assert args.speculative_verify_size == 16 and args.speculative_one_branch is True
    assert ServerArgs(**hybrid_args(head, "tree", adaptive=True)).speculative_verify_size == 6


# ---- sampling: the target's distribution, with drafts from both sources in the same steps ----
SAMPLES = 4000


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """test_spec_sampling's 16-token target (its exact distribution enumerable) and a random head for it."""
    root = tmp_path_factory.mktemp("hybrid-letters")
    model = make_tiny_directory(root / "target", "llama", vocab_size=VOCAB, tokenizer="letters", weight_std=None,
                                logit_scale=20.0)
    save_random_eagle_head(root / "target", root / "head", algorithm="EAGLE3")
    return root / "target", root / "head", model.double()


@pytest.mark.parametrize("split, rule", [("half", "coupled"), ("half", "rejection"), ("head", "rejection")])
def test_sampled_output_follows_the_target_with_drafts_from_either_source(letters, split, rule):
    """Half the requests (by id) take the trie's drafts on every other step, the others there
    their roots alone (their pending chains were sampled from q, which a step of trie drafts
    does not carry), and every request the head's on the steps between (the fused step's
    chains sampled from q, verified with it); or every request the head's on every step. The
    first four tokens' joint distribution is the target's. Unseeded requests: a seeded one's
    chain is always the head's argmax."""
    target, head, model = letters
    with tiny_engine(target, **hybrid_args(head, speculative_num_draft_tokens=4), max_running_requests=1024,
                     max_total_tokens=32768) as engine:
        engine.core.sampler.sampling_rule = rule
        drafter = engine.core.drafter
        choose, steps = drafter.choice.choose, []

        def forced(rids, trie_nodes, trie_keys, *price):
            choose(rids, trie_nodes, trie_keys, *price)   # its bookkeeping
            trie_step = split == "half" and len(steps) % 2 == 0
            use_trie = np.array([trie_step and nodes > 1 and zlib.crc32(rid.encode()) % 2 == 0
                                 for rid, nodes in zip(rids, trie_nodes)])
            steps.append([use_trie.any(), None])
            return use_trie

        def spied(name):   # which of the head's proposals a step took, and whether it came with a q
            method = getattr(drafter.head, name)

            def called(reqs, max_nodes):
                proposal, num_nodes = method(reqs, max_nodes)
                if max(num_nodes) > 1:
                    steps[-1][1] = (name, proposal.draft_probs is not None)
                return proposal, num_nodes
            return called

        drafter.choice.choose = forced
        drafter.head.propose, drafter.head.pending_chains = spied("propose"), spied("pending_chains")
        params = [{"temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}] * SAMPLES
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        used = sources(outputs)
        if split == "half":
            assert min(used.get("ngram", 0), used.get("head", 0)) > SAMPLES // 8, used
        else:
            assert list(used) == ["head"], used
        # steps with trie drafts took the head's pending argmax chains (no q); the others its fused
        # step's chains, whose q stays on the device (fused_chain.py's q table)
        drafted = [(trie, taken) for trie, taken in steps if taken is not None]
        assert drafted and all(taken == (("pending_chains", False) if trie else ("propose", False))
                               for trie, taken in drafted), drafted
        assert sum(o["meta_info"]["spec_accept_length"] > 1 for o in outputs) > SAMPLES // 4
        wait_until_everything_is_free(engine)
    p = chi_square_p(outputs, exact_joint(exact_step_logits(model), temperature=1.0))
    assert p > ALPHA, f"chi-square p = {p:.3g}"


def test_the_warmup_leaves_the_hybrid_drafter_as_it_found_it(models):
    """The start-up warm-up (a GPU engine's; handed a small plan here) drafts through a scratch
    hybrid drafter: afterwards the trie holds none of its prompts, the head none of its rows,
    and outputs are a cold engine's."""
    from tests.test_warmup import EVERY_PHASE, planned_warmup
    target, head = models
    args = {**hybrid_args(head, adaptive=True, speculative_num_draft_tokens=4), "chunked_prefill_size": 24}
    with tiny_engine(target, **args) as cold:
        expected = [o["output_ids"] for o in two_turns(cold, GREEDY)]
        with planned_warmup(EVERY_PHASE) as reports, tiny_engine(target, **args) as warm:
            assert reports[0].steps >= 30 and "trees of 2/4 nodes" in reports[0].summary()
            assert warm.core.drafter.ngram.trie.num_nodes() == 0 and not warm.core.drafter.head.kv.sequences
            assert [o["output_ids"] for o in two_turns(warm, GREEDY)] == expected
            wait_until_everything_is_free(warm)


def test_a_failing_forecast_step_record_fails_no_request_and_leaks_nothing(models, plain, monkeypatch):
    """The hybrid's record of a forecast step (forecast_held, as the step is held) raising once
    for one request: a forecast runs only for a batch whose next step is launched ahead, so the
    failure isolation's one-by-one steps never meet it: every request finishes with plain
    decoding's tokens, and the slots of the forecast step that was not held are all back. (A
    fault that stays may fail the victim, whose later batches are forecast again, as any
    request fails whose own step keeps failing.)"""
    from tests.test_failure_isolation import failing_for_victim
    # the trie preferred wherever it has a measured match: batches of trie drafts alone, which forecast
    monkeypatch.setattr(SourceChoice, "expected_from_head", lambda self, rid: 1.0)
    target, head = models
    rids = ["first", "victim", "last"]
    with tiny_engine(target, **hybrid_args(head, speculative_ngram_forecast=2)) as engine:
        ahead_on(engine)
        gate = engine.core.drafting.forecast_gate
        wants = gate.wants
        gate.wants = lambda records, batch_size: (True, wants(records, batch_size)[1])

        async def together():
            return await asyncio.gather(*(engine.async_generate(input_ids=p, sampling_params=GREEDY, rid=r)
                                          for p, r in zip(PROMPTS, rids)))
        with failing_for_victim(engine.core, "drafter", "forecast_held", 2, at_most=1) as calls:
            results = asyncio.run(together())
        assert calls["failed"] >= 1
        assert [r["output_ids"] for r in results] == plain["greedy"][:3]
        wait_until_everything_is_free(engine)
