"""NAIVE_EAGLE and MTP on a GPU (fp32): the fused verify-and-draft step replayed from its CUDA
graphs (one per batch bucket and verification kind) and run eagerly (batches larger than
the graphs) gives the verify steps the trainer's replay predicts (heads trained on the CPU by
tests/test_eagle_drafter.py's fixtures), MTP drafts that are the transformers reference's
argmax (tests/test_mtp.py), greedy output equal to plain decoding, seeded sampling equal to
plain decoding through the coupled graphs, unseeded sampling through the rejection graphs,
and every target and head KV slot back."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.speculative.model_drafters.fused_chain import FusedGraphs
from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_eval import accepted_runs, replay_decoding
from tests.fused_fixtures import FusedSpy, fused_args, wait_until_fused_state_is_free
from tests.spec_fixtures import tiny_engine
from tests.test_eagle_drafter import head_dir, target  # noqa: F401
from tests.test_mtp import GREEDY, PROMPTS, DraftSpy, copy_head, reference_drafts, target_dir  # noqa: F401

CUDA = {"device": "cuda", "max_total_tokens": 4096}


class GraphKinds:
    """The kind of every fused graph replay ("chained": one whose inputs the step before
    derived on the device, engine/draft_ahead.py, of that step's kind)."""

    def __init__(self, monkeypatch):
        self.replays = Counter()
        original, chained = FusedGraphs.replay, FusedGraphs.replay_chained

        def replay(graphs, reqs, proposal, node_slots, head_slots, head_rows, kind):
            self.replays[kind] += 1
            return original(graphs, reqs, proposal, node_slots, head_slots, head_rows, kind)

        def replay_chained(graphs, *args):
            self.replays["chained"] += 1
            return chained(graphs, *args)
        monkeypatch.setattr(FusedGraphs, "replay", replay)
        monkeypatch.setattr(FusedGraphs, "replay_chained", replay_chained)


@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the batches of 8 run eagerly
def test_naive_eagle_verify_steps_match_the_replay_on_cuda(target, head_dir, graph_max_bs, monkeypatch):  # noqa: F811
    path, _, _, held_out = target
    _, head_path, head, extractor = head_dir
    graphs = GraphKinds(monkeypatch)
    with tiny_engine(path, cuda_graph_max_bs=graph_max_bs, **CUDA, **fused_args("NAIVE_EAGLE", head_path)) as engine:
        assert engine.core.drafter.fused.graphs is not None
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        wait_until_fused_state_is_free(engine)
    assert spy.engine == 0 and graphs.replays["greedy"] > 0
    # pinned drafting on the overlap schedule: steps chained on the device (graphs, and eager batches too)
    assert spy.chained > 0 and (graph_max_bs != 8 or graphs.replays["chained"] > 0), (spy.chained, graphs.replays)
    batch = BatchBuilder(extractor, None, bool(head.config.aux_layers))(held_out).conversations
    with torch.no_grad():
        runs = accepted_runs(head, batch, 1).cpu()
    steps = [replay_decoding(runs[i:i + 1], [len(c.tokens)], [c.prompt_len]).verify_steps for i, c in enumerate(held_out)]
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == steps


@pytest.mark.parametrize("graph_max_bs", [8, 2])
def test_mtp_drafts_are_the_reference_on_cuda(target_dir, copy_head, graph_max_bs):  # noqa: F811
    with tiny_engine(target_dir, **CUDA) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    with tiny_engine(target_dir, cuda_graph_max_bs=graph_max_bs, **CUDA, **fused_args("MTP", copy_head)) as engine:
        drafts = DraftSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == expected
        wait_until_fused_state_is_free(engine)
    references = {tuple(p): reference_drafts(target_dir, copy_head, p + e) for p, e in zip(PROMPTS, expected)}
    wrong = [(length, draft) for prompt, length, draft in drafts.drafts if references[prompt][length - 2] != draft]
    assert drafts.drafts and not wrong, f"{len(wrong)} of {len(drafts.drafts)} drafts differ from the reference"


def test_sampling_runs_through_the_coupled_and_rejection_graphs(target_dir, copy_head, monkeypatch):  # noqa: F811
    prompts = PROMPTS[:4]
    seeded = [{"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "seed": 3 + i} for i in range(4)]
    with tiny_engine(target_dir, **CUDA) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=seeded)]
    graphs = GraphKinds(monkeypatch)
    with tiny_engine(target_dir, **CUDA, **fused_args("MTP", copy_head)) as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=seeded)] == expected
        sampled = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.8, "top_k": 20,
                                                                      "max_new_tokens": 16, "ignore_eos": True})
        assert [len(o["output_ids"]) for o in sampled] == [16] * 4
        assert sum(o["meta_info"]["spec_accept_histogram"].get(2, 0) for o in sampled) > 0
        wait_until_fused_state_is_free(engine)
    # sampled steps are chained too (engine/draft_ahead.py): the seeded tokens above are plain decoding's
    assert graphs.replays["coupled"] > 0 and graphs.replays["rejection"] > 0 and graphs.replays["chained"] > 0
