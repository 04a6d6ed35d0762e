"""FR-Spec maps on a GPU (fp32): the head's restricted lm_head and the draft-id -> target-id
gather run inside the chain and tree CUDA graphs (and eagerly: batches larger than the
graphs). Chains draft only the map's tokens with greedy output unchanged; trees equal the
CPU reference of the head restricted to the map (tests/test_token_map.py)."""
from __future__ import annotations

import pytest

from tests.test_eagle_drafter import head_dir, target  # noqa: F401
from tests.test_eagle_drafter_tree import check_trees
from tests.test_token_map import check_map_chains, frequent_answer_map, restricted_head  # noqa: F401

CUDA = {"device": "cuda", "max_total_tokens": 4096}


@pytest.mark.parametrize("graph_max_bs", [8, 2])     # 2: the batches of 8 run eagerly
def test_chains_with_a_map_on_cuda(target, head_dir, frequent_answer_map, graph_max_bs):  # noqa: F811
    check_map_chains(target, head_dir, frequent_answer_map, cuda_graph_max_bs=graph_max_bs, **CUDA)


@pytest.mark.parametrize("graph_max_bs", [8, 2])
def test_trees_with_a_map_are_the_restricted_heads_reference_trees_on_cuda(target, head_dir,  # noqa: F811
                                                                          frequent_answer_map, graph_max_bs):
    algorithm, head_path, _, extractor = head_dir
    map_path, allowed = frequent_answer_map
    check_trees(target, (algorithm, head_path, restricted_head(head_dir, allowed), extractor), 2, 3, 6,
                longest_accepted=3, speculative_token_map=map_path, cuda_graph_max_bs=graph_max_bs, **CUDA)
