"""EAGLE / EAGLE3 on a GPU (fp32): the target's verify graphs keep the hidden states the head
reads, so greedy output equals plain decoding and every request's verify steps are the
ones the trainer's replay predicts (heads trained on the CPU by tests/test_eagle_drafter.py's
fixtures), through the graphs and eagerly (batches larger than the graphs); EAGLE-2 trees
built in the graphs equal the CPU reference's (tests/test_eagle_drafter_tree.py)."""
from __future__ import annotations

import pytest
import torch

from specserve.speculative.eagle_batches import BatchBuilder
from specserve.speculative.eagle_eval import accepted_runs, replay_decoding
from tests.spec_fixtures import tiny_engine
from tests.test_eagle_drafter import NUM_STEPS, eagle_args, head_dir, target, wait_until_head_kv_is_free  # noqa: F401
from tests.test_eagle_drafter_tree import TREES, check_trees


@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the batches of 8 run eagerly
def test_eagle_verify_steps_match_the_replay_on_cuda(target, head_dir, graph_max_bs):  # noqa: F811
    path, _, _, held_out = target
    algorithm, head_path, head, extractor = head_dir
    with tiny_engine(path, device="cuda", cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096,
                     **eagle_args(algorithm, head_path)) as engine:
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out],
                                  sampling_params={"temperature": 0.0, "max_new_tokens": 32})
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        wait_until_head_kv_is_free(engine)
    batch = BatchBuilder(extractor, None, bool(head.config.aux_layers))(held_out).conversations
    with torch.no_grad():
        runs = accepted_runs(head, batch, NUM_STEPS).cpu()
    steps = [replay_decoding(runs[i:i + 1], [len(c.tokens)], [c.prompt_len]).verify_steps for i, c in enumerate(held_out)]
    assert [o["meta_info"]["spec_verify_ct"] for o in outputs] == steps


@pytest.mark.parametrize("graph_max_bs", [8, 2])
@pytest.mark.parametrize("topk,steps,nodes", TREES[:2])
def test_eagle_trees_are_the_reference_trees_on_cuda(target, head_dir, topk, steps, nodes, graph_max_bs):  # noqa: F811
    check_trees(target, head_dir, topk, steps, nodes, longest_accepted=3, device="cuda",
                cuda_graph_max_bs=graph_max_bs, max_total_tokens=4096)
