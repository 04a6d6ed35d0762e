"""EAGLE / EAGLE3 on a GPU (fp32): chains of K drafts (top-k 1) run through the fused step
(speculative/model_drafters/fused_chain.py), replayed from its CUDA graphs (one per batch bucket and
verification kind) and eagerly (batches larger than the graphs): greedy output equals plain
decoding and every request's verify steps are the ones the trainer's replay predicts (heads
trained on the CPU by tests/test_eagle_drafter.py's fixtures); seeded sampling gives plain
decoding's tokens through the coupled graphs, unseeded sampling runs through the rejection
graphs; every target and head KV slot comes back. EAGLE-2 trees, verified and drafted in the
fused step's graphs (chained where launched ahead), equal the CPU reference's
(tests/test_eagle_drafter_tree.py). With the
adaptive policy (tests/test_eagle_adaptive.py's scripted plain stretches, the plain steps
launched ahead from the decode graphs, whose hidden-state outputs the next replay
overwrites), output stays plain decoding's and every draft after a plain stretch is the
reference's of a head fed the whole context."""
from __future__ import annotations

import pytest
import torch

from specserve.attention import triton_backend
from specserve.speculative.model_drafters import eagle
from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_eval import accepted_runs, replay_decoding
from tests.fused_fixtures import FusedSpy, wait_until_fused_state_is_free
from tests.gpu.test_naive_eagle_cuda import GraphKinds
from tests.spec_fixtures import tiny_engine
from tests.test_eagle_drafter import eagle_args, head_dir, target  # noqa: F401
from tests.test_eagle_adaptive import check_chain_stretches, check_tree_stretches
from tests.test_eagle_drafter_tree import TREES, check_trees, random_head  # noqa: F401

CUDA = {"device": "cuda", "max_total_tokens": 4096}


def verify_through_tree_groups(monkeypatch) -> list[int]:
    """Every VERIFY batch through tree_groups.py (none as decode rows); the list counts its launches."""
    launches = []
    monkeypatch.setattr(triton_backend.TritonBackend, "max_tree_rows", 0)
    monkeypatch.setattr(triton_backend.TritonBackend, "max_group_rows", triton_backend.MAX_GROUP_ROWS)
    original = triton_backend.tree_group_attention
    monkeypatch.setattr(triton_backend, "tree_group_attention",
                        lambda *args, **kwargs: (launches.append(1), original(*args, **kwargs)))
    return launches


@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the batches of 8 run eagerly
@pytest.mark.parametrize("num_steps", [1, 3])
@pytest.mark.parametrize("verify_attention", ["default", "tree-groups"])
def test_eagle_verify_steps_match_the_replay_on_cuda(target, head_dir, graph_max_bs, num_steps, verify_attention,  # noqa: F811
                                                     monkeypatch):
    path, _, _, held_out = target
    algorithm, head_path, head, extractor = head_dir
    graphs = GraphKinds(monkeypatch)
    groups = verify_through_tree_groups(monkeypatch) if verify_attention == "tree-groups" else None
    with tiny_engine(path, cuda_graph_max_bs=graph_max_bs, **CUDA,
                     **eagle_args(algorithm, head_path, speculative_num_steps=num_steps)) as engine:
        assert engine.core.drafter.fused.graphs is not None
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        wait_until_fused_state_is_free(engine)
    assert spy.engine == 0 and graphs.replays["greedy"] > 0
    assert groups is None or groups, "no verify step went through tree_groups.py"
    # pinned drafting on the overlap schedule: steps chained on the device (graphs, and eager batches too)
    assert spy.chained > 0 and (graph_max_bs != 8 or graphs.replays["chained"] > 0), (spy.chained, graphs.replays)
    batch = BatchBuilder(extractor, None, bool(head.config.aux_layers))(held_out).conversations
    with torch.no_grad():
        runs = accepted_runs(head, batch, num_steps).cpu()
    steps = [replay_decoding(runs[i:i + 1], [len(c.tokens)], [c.prompt_len]).verify_steps for i, c in enumerate(held_out)]
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == steps


def test_eagle_sampling_runs_through_the_coupled_and_rejection_graphs(target, head_dir, monkeypatch):  # noqa: F811
    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    prompts = [c.tokens[:c.prompt_len] for c in held_out[:4]]
    seeded = [{"temperature": 1.0, "max_new_tokens": 24, "ignore_eos": True, "seed": 3 + i} for i in range(4)]
    with tiny_engine(path, **CUDA) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=seeded)]
    graphs = GraphKinds(monkeypatch)
    with tiny_engine(path, **CUDA, **eagle_args(algorithm, head_path)) as engine:
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=seeded)] == expected
        sampled = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.8, "max_new_tokens": 24,
                                                                      "ignore_eos": True})
        assert [len(o["output_ids"]) for o in sampled] == [24] * 4
        assert any(k > 1 for o in sampled for k in o["meta_info"]["spec_accept_histogram"])
        wait_until_fused_state_is_free(engine)
    # sampled steps are chained too (engine/draft_ahead.py): the seeded tokens above are plain decoding's
    assert graphs.replays["coupled"] > 0 and graphs.replays["rejection"] > 0 and graphs.replays["chained"] > 0


@pytest.mark.parametrize("graph_max_bs", [8, 2])
@pytest.mark.parametrize("topk,steps,nodes", TREES[:2])
def test_eagle_trees_are_the_reference_trees_on_cuda(target, head_dir, topk, steps, nodes, graph_max_bs):  # noqa: F811
    check_trees(target, head_dir, topk, steps, nodes, longest_accepted=3, device="cuda",
                cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096)


@pytest.mark.parametrize("graph_max_bs", [8, 2])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "verify"])
def test_eagle_trees_after_plain_stretches_on_cuda(target, random_head, graph_max_bs, overlap,  # noqa: F811
                                                   monkeypatch):
    monkeypatch.setattr(eagle, "HELD_STATES_BYTES", 1)    # plain stretches fed by observe_batch too
    check_tree_stretches(target, random_head, overlap, device="cuda", cuda_graph_max_bs=graph_max_bs,
                         max_total_tokens=4096)


@pytest.mark.parametrize("graph_max_bs", [8, 2])
@pytest.mark.parametrize("algorithm,steps", [("EAGLE3", 3), ("NAIVE_EAGLE", 1)], ids=["K3", "naive"])
def test_eagle_chains_after_plain_stretches_on_cuda(target, random_head, algorithm, steps, graph_max_bs):  # noqa: F811
    check_chain_stretches(target, random_head, algorithm, steps, True, device="cuda",
                          cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096)
