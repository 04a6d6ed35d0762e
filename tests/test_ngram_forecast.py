"""NGRAM steps launched before the step before them is read, their drafts picked on the device
from the trie's forecast (runner/forecast_step.py, speculative/ngram/forecast.py,
engine/draft_ahead.py's ForecastStep). The device's pick and the host's agree; an entry's
tree is the one the trie proposes after that outcome; and an engine that forecasts (CPU,
drafting steps launched ahead forced on) gives plain decoding's outputs, the very trees a
proposal after the read would verify where the forecast hit, and every KV slot back."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.args import ArgumentError, NotSupportedError, ServerArgs
from specserve.engine.draft_ahead import ForecastStep
from specserve.kv.pool import PADDING_SLOT
from specserve.runner.forecast_step import NO_ENTRY, empty_table, select_on_device
from specserve.runner.tree_step import TreeStepInputs
from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.drafter import DEFAULT_FORECAST
from specserve.speculative.ngram.forecast import forecast_table
from specserve.speculative.ngram.trie import NgramTrie
from specserve.speculative.registry import create_drafter
from specserve.verify.tree import TreeProposal

from tests.forecast_fixtures import picked_by_host, random_case
from tests.spec_fixtures import ngram_args, price_steps
from tests.test_draft_ahead import ahead_on, assert_plain_answers, plain, plain_answers  # noqa: F401 (fixtures)
from tests.test_kv_accounting import wait_until_all_kv_is_free


@pytest.mark.parametrize("nodes", [4, 3])   # the table's trees whole, or their first 3 nodes
def test_device_and_host_pick_the_same_trees(nodes):
    bs, n = 6, 4
    table, outcome = random_case(0, bs, 3, 2, n, 3)
    picked = picked_by_host(table, outcome, nodes)
    assert 0 < picked.found.sum() < bs   # some requests found their entry, some did not
    assert picked.verified.tokens.tolist() == picked.full.tokens[:, :nodes].tolist()

    width = 6   # a graph's buffer may be wider than the step's trees
    inputs = TreeStepInputs.allocate(bs + 2, width, "cpu")
    inputs.tokens.fill_(0)
    inputs.parents.fill_(-1)
    inputs.out_slots.fill_(PADDING_SLOT)
    inputs.prefix_lens[:bs] = torch.arange(bs) * 100
    node_slots = torch.arange(bs * nodes).view(bs, nodes) + 1000
    select_on_device(inputs, torch.from_numpy(outcome), torch.from_numpy(table), node_slots)
    proposal = picked.verified
    assert inputs.num_nodes[:bs].tolist() == proposal.num_nodes.tolist()
    assert inputs.tokens[:bs, :nodes].tolist() == proposal.tokens.tolist()
    assert inputs.parents[:bs, :nodes].tolist() == proposal.parents.tolist()
    real = np.arange(nodes) < proposal.num_nodes[:, None]
    assert inputs.out_slots[:bs, :nodes].tolist() == np.where(real, node_slots.numpy(), PADDING_SLOT).tolist()
    assert inputs.prefix_lens[:bs].tolist() == (np.arange(bs) * 100 + outcome[:, 0]).tolist()
    assert inputs.tokens[bs:].eq(0).all() and inputs.tokens[:, nodes:].eq(0).all()   # padding untouched


def test_an_entry_is_the_tree_the_trie_proposes_after_that_outcome():
    trie = NgramTrie(NgramConfig())
    text = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 1, 2, 9, 1, 2, 3, 4, 6]
    trie.insert(text, 0)
    context = [5, 1, 2]
    # the chain N verifies: root 2, drafts 3 -> 4
    proposal = TreeProposal.from_lists([([2, 3, 4], [-1, 0, 1])])
    table = forecast_table(trie, [context], [0], proposal, 4, 2, True, 6)
    assert table.shape == (1, 3, 2, 9)
    paths = [[], [3], [3, 4]]
    children = [{3}, {4}, set()]
    for j, (path, excluded) in enumerate(zip(paths, children)):
        after = context + path
        for c in range(2):
            entry = table[0, j, c]
            if entry[0] == NO_ENTRY:
                continue
            assert entry[0] not in excluded
            tokens, parents = trie.propose(after + [int(entry[0])], 4, True, 0)
            count = int(entry[7])
            assert count == 1 + len(tokens)
            assert entry[1:count].tolist() == tokens
            assert entry[4:3 + count].tolist() == [p + 1 for p in parents]   # propose counts its root as -1
    # after "5 1 2" with 3 rejected, the trie's other continuation of "1 2" is 9
    assert 9 in table[0, 0, :, 0].tolist()
    # after "1 2 3" with 4 rejected: 7
    assert table[0, 1, 0, 0] == 7


@pytest.mark.parametrize("one_branch", [True, False])
def test_the_c_forecast_is_the_python_one(one_branch):
    """trie.c's ngt_forecast against forecast_table's loops over the same compiled trie, and the
    pure-Python trie's forecast: random streams of a small vocabulary (long and short matches),
    several owners, chains and trees of N's drafts (the trie's own proposals and random ones)."""
    from specserve.speculative.ngram.trie_py import PythonNgramTrie
    rng = np.random.default_rng(1)
    compiled, python = NgramTrie(NgramConfig()), PythonNgramTrie(NgramConfig())
    assert type(compiled) is NgramTrie   # the C trie (CI has a compiler)
    streams = [rng.integers(0, 12, 400).tolist() for _ in range(3)]
    for owner, stream in enumerate(streams):
        for trie in (compiled, python):
            trie.insert(stream[:300], owner)
    contexts = [stream[:300] for stream in streams] + [rng.integers(0, 12, 5).tolist()]
    owners = [0, 1, 2, 7]
    rows = []
    for context, owner in zip(contexts, owners):
        tokens, parents = compiled.propose(context, 6, one_branch, owner)
        rows.append(([context[-1]] + tokens, [-1] + [p + 1 for p in parents]))
    rows.append(([contexts[0][-1], 3, 5, 3], [-1, 0, 0, 1]))   # a tree with a node of two children
    contexts.append(contexts[0])
    owners.append(0)
    proposal = TreeProposal.from_lists(rows)
    for nodes, candidates in ((5, 2), (2, 1), (9, 3)):
        expected = forecast_table(compiled, contexts, owners, proposal, nodes, candidates, one_branch, 6)
        got = compiled.forecast(contexts, owners, proposal, nodes, candidates, one_branch, 6)
        assert got.tolist() == expected.tolist()
        assert python.forecast(contexts, owners, proposal, nodes, candidates, one_branch, 6).tolist() == expected.tolist()
        assert (expected[..., 0] != NO_ENTRY).sum() > len(rows)   # most nodes found candidates


def test_the_flag_is_checked():
    assert ServerArgs(model_path="m", **ngram_args(8, speculative_ngram_forecast=2)).speculative_ngram_forecast == 2
    with pytest.raises(ArgumentError, match="speculative_ngram_forecast"):
        ServerArgs(model_path="m", **ngram_args(8, speculative_ngram_forecast=-1))
    with pytest.raises(NotSupportedError, match="speculative_ngram_forecast"):
        ServerArgs(model_path="m", speculative_algorithm="EAGLE", speculative_draft_model_path="h",
                   speculative_ngram_forecast=2)


def test_the_forecast_is_on_by_default_on_a_gpu_only():
    def candidates(on_gpu: bool, **flags) -> int:
        drafter = create_drafter(ServerArgs(model_path="m", **ngram_args(8, **flags)), on_gpu)
        try:
            return drafter.forecast_candidates
        finally:
            drafter.close()
    assert candidates(True) == DEFAULT_FORECAST > 0
    assert candidates(False) == 0
    assert candidates(True, speculative_ngram_forecast=0) == 0
    assert candidates(False, speculative_ngram_forecast=3) == 3


def _count_holds(engine) -> tuple[list, list, object]:
    """Records each forecast step held: for the hits, its trees whole beside the trees a
    proposal after the read makes at that moment (the trie as the forecast saw it) of as many
    nodes; and each step's width, checking that it verifies its trees' first nodes."""
    seen, widths = [], []
    hold = ForecastStep.hold
    drafter = engine.core.drafter

    def recording(self, scheduler, drafter_, before, live, started):
        step, proposed, num_nodes, keys = hold(self, scheduler, drafter_, before, live, started)
        width, whole = self.node_slots.shape[1], (self.table.shape[-1] - 1) // 2
        widths.append(width)
        verified = step.tree
        assert verified.tokens.tolist() == proposed.tokens[:, :width].tolist()
        assert verified.num_nodes.tolist() == np.minimum(proposed.num_nodes, width).tolist()
        after, counts = drafter.propose(step.reqs, [whole] * len(step.reqs))
        for i, count in enumerate(num_nodes):
            if count > 1:   # a hit with drafts: the tree a proposal after the read makes
                seen.append((proposed.tokens[i, :count].tolist(), after.tokens[i, :counts[i]].tolist(),
                             proposed.parents[i, :count].tolist(), after.parents[i, :counts[i]].tolist()))
        return step, proposed, num_nodes, keys
    return seen, widths, recording


@pytest.mark.parametrize("adaptive", [False, True])
def test_forecast_steps_give_plain_outputs_and_the_trees_of_a_proposal_after_the_read(
        engine_factory, plain_answers, adaptive, monkeypatch):
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, one_branch=True, adaptive=adaptive,
                                                                         speculative_ngram_forecast=2)))
    if adaptive:
        price_steps(engine, 0.010, 0.001)
    seen, widths, recording = _count_holds(engine)
    monkeypatch.setattr(ForecastStep, "hold", recording)
    assert_plain_answers(engine, plain_answers)
    assert len(seen) > 5
    # pinned, every step verifies the full size; under the policy, its tiers (test_forecast_width)
    assert set(widths) <= set(range(2, 9)) and (adaptive or set(widths) == {8}), widths
    for tokens, after, parents, after_parents in seen:
        assert tokens == after and parents == after_parents
    gate = engine.core.drafting.forecast_gate
    assert gate.picks >= len(seen) and 0 < gate.found <= gate.picks
    wait_until_all_kv_is_free(engine)


def test_a_table_without_entries_launches_no_step(engine_factory, plain_answers, monkeypatch):
    """Whatever the outcome, such a table gives roots alone: no step is launched from it, and
    the steps after the read are what they are without forecasts."""
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, one_branch=True,
                                                                         speculative_ngram_forecast=2)))
    drafter, asked = engine.core.drafter, []
    empty = lambda reqs, proposal, nodes: asked.append(len(reqs)) or empty_table(len(reqs), proposal.num_slots, 2, nodes)
    monkeypatch.setattr(drafter, "forecast", empty)
    monkeypatch.setattr(ForecastStep, "hold", lambda *args: pytest.fail("a step was launched from an empty table"))
    assert_plain_answers(engine, plain_answers)
    assert asked and engine.core.draft_ahead.steps_taken > 10   # asked, and steps ahead launched after the read


def test_forecast_width():
    """A forecast step's width: the tier the policy chose given the trees of the step before
    whole, else that step's width; pinned, the full size; within [2, the full size]."""
    from types import SimpleNamespace

    from specserve.engine.draft_ahead import DraftStep
    from specserve.engine.drafting_step import DraftingStep

    def width(adaptive: bool, step_width: int, next_width: int | None) -> int:
        pipeline = SimpleNamespace(planner=SimpleNamespace(num_draft_tokens=8, adaptive=object() if adaptive else None))
        step = DraftStep([], np.ones(1, dtype=np.int64), np.zeros((1, step_width), dtype=np.int64), [], None, None,
                         0.0, next_width=next_width)
        return DraftingStep._forecast_width(pipeline, step)
    assert width(True, 4, None) == 4 and width(True, 4, 6) == 6 and width(True, 4, 16) == 8
    assert width(False, 4, None) == 8 and width(True, 1, None) == 2


def test_the_policy_s_tier_is_the_next_forecast_step_s_width(engine_factory, plain_answers, monkeypatch):
    """The tier choose_chained returns for a held forecast step (here forced to 3) is the width
    of the forecast step launched from it; outputs stay plain decoding's."""
    from specserve.engine.draft_planner import DraftPlanner
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, one_branch=True, adaptive=True,
                                                                         speculative_ngram_forecast=2)))
    price_steps(engine, 0.010, 0.001)
    seen, widths, recording = _count_holds(engine)
    monkeypatch.setattr(ForecastStep, "hold", recording)
    choose = DraftPlanner.choose_chained
    monkeypatch.setattr(DraftPlanner, "choose_chained", lambda *args: (choose(*args)[0], 3))
    assert_plain_answers(engine, plain_answers)
    assert widths.count(3) >= len(widths) // 2 and 3 in widths, widths   # the first of a chain takes its step's


def test_forecasts_that_never_find_their_entry_give_way_to_proposals_after_the_read(
        engine_factory, plain_answers, monkeypatch):
    """Where no outcome finds its entry (every entry's token here one no outcome has), each
    forecast step verifies a root alone: after a few, a request's steps are proposed after the
    read again (request/forecast_record.py), with a probe now and then; the code prompt's
    drafts stay long and outputs plain decoding's."""
    engine = ahead_on(engine_factory(max_total_tokens=4096, **ngram_args(8, one_branch=True,
                                                                         speculative_ngram_forecast=2)))
    drafter, held = engine.core.drafter, []
    forecast, hold = drafter.forecast, ForecastStep.hold

    def never_found(reqs, proposal, nodes):
        table = forecast(reqs, proposal, nodes)
        table[..., 0][table[..., 0] != NO_ENTRY] = -2
        return table

    def counting(self, *args):
        held.append(len(self.reqs))
        return hold(self, *args)
    monkeypatch.setattr(drafter, "forecast", never_found)
    monkeypatch.setattr(ForecastStep, "hold", counting)
    assert_plain_answers(engine, plain_answers)   # the code prompt alone commits > 2 tokens a step
    taken = engine.core.draft_ahead.steps_taken
    assert held and len(held) < taken / 2, (len(held), taken)   # its first misses, then probes
    gate = engine.core.drafting.forecast_gate   # every request's pick counted, none found
    assert gate.picks == sum(held) and gate.found == 0 and gate.hit_rate < 0.8   # a new request starts lower
    wait_until_all_kv_is_free(engine)
