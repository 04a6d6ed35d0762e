"""The device-side verify step on a GPU: greedy NGRAM output equals plain decoding through
the captured graphs (tree metadata, verification and the KV-table commit inside them) and
through the eager path (batches larger than the graphs), with each drafting step launched
right after the previous one's commit, and every KV slot comes back."""
from __future__ import annotations

import pytest

from tests.spec_fixtures import make_tiny_directory, ngram_args, price_steps, tiny_engine, wait_until_all_kv_is_free
from tests.test_step_kv_writes import PROMPTS

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-cuda-tree-step")
    make_tiny_directory(path, "llama", seed=3)
    return path


@pytest.mark.parametrize("one_branch", [False, True])
@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the 5-request batches run eagerly
def test_greedy_ngram_equals_plain_on_cuda(model_dir, one_branch, graph_max_bs):
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096,
                     # pinned size: full trees verified; proposed after the read (the forecast's steps:
                     # test_forecast_steps_equal_plain_on_cuda)
                     **ngram_args(16, one_branch=one_branch, speculative_ngram_forecast=0)) as engine:
        accepted = 0
        for _ in range(2):  # the second pass drafts from the first's outputs: long accepted paths
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == expected
            accepted = max(accepted, max(max(o["meta_info"]["spec_accept_histogram"]) for o in outputs))
        assert accepted >= 4
        assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outputs)
        assert engine.core.draft_ahead.steps_taken > 10   # steps launched ahead (engine/draft_ahead.py)
        wait_until_all_kv_is_free(engine)


def test_ragged_graph_steps_with_cut_drafts_equal_plain_on_cuda(model_dir):
    """The ragged verify graphs (runner/cuda_graph.py): steps where every other request
    verifies its root alone (a cut forced on the adaptive policy's choice) replay a level
    smaller than the whole trees', and greedy output still equals plain decoding."""
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=8, max_total_tokens=4096,
                     **ngram_args(16, adaptive=True, speculative_ngram_forecast=0)) as engine:
        price_steps(engine, 0.010, 0.0001)
        adaptive, graphs, levels = engine.core.adaptive, engine.core.runner.graphs, []
        choose_nodes, replay = adaptive.choose_nodes, graphs.replay

        def cutting(rids, num_nodes, keys=None):
            return [1 if i % 2 else n for i, n in enumerate(choose_nodes(rids, num_nodes, keys))]

        def replaying(proposal, *args, **kwargs):
            if proposal.num_slots > 1:
                levels.append((graphs.key_for(proposal)[1], proposal.num_slots))
            return replay(proposal, *args, **kwargs)
        adaptive.choose_nodes, graphs.replay = cutting, replaying
        for _ in range(2):
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == expected
        assert any(level < width for level, width in levels), levels   # a level below the whole trees'
        wait_until_all_kv_is_free(engine)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the 5-request batches run eagerly
def test_forecast_steps_equal_plain_on_cuda(model_dir, adaptive, graph_max_bs, monkeypatch):
    """Verify steps launched before the step before them is read, their trees picked on the
    device from the trie's forecast (runner/forecast_step.py, --speculative-ngram-forecast):
    through the graphs (a derived input buffer, two outcomes on their way at once) and
    eagerly, plain decoding's outputs, forecasts that hit, and every KV slot back."""
    from specserve.engine.draft_ahead import ForecastStep
    with tiny_engine(model_dir, device="cuda", disable_cuda_graph=True, max_total_tokens=4096) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    from specserve.request.forecast_record import ForecastGate
    held, hold = [], ForecastStep.hold
    # every step forecast: the gate weighs what a forecast hides against the cycles it measured,
    # and a tiny model's eager steps hide nothing (it held the batch to a few probes)
    # (the gate's own decision still runs: it starts each new request's record)
    wants = ForecastGate.wants
    monkeypatch.setattr(ForecastGate, "wants", lambda self, records, bs: (True, wants(self, records, bs)[1]))

    def holding(self, *args):
        step, tree, num_nodes, keys = hold(self, *args)
        held.append(sum(count > 1 for count in num_nodes))
        return step, tree, num_nodes, keys
    monkeypatch.setattr(ForecastStep, "hold", holding)
    with tiny_engine(model_dir, device="cuda", cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096,
                     **ngram_args(8, one_branch=True, adaptive=adaptive, speculative_ngram_forecast=2)) as engine:
        if adaptive:
            price_steps(engine, 0.010, 0.0001)
        for _ in range(2):  # the second pass drafts from the first's outputs
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == expected
        solo = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["output_ids"]
        assert solo == expected[0]
        assert len(held) > 10 and sum(held) > 10, held   # held forecast steps, hits with drafts among them
        wait_until_all_kv_is_free(engine)
