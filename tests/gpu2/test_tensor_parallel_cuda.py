"""Tensor parallelism on 2 GPUs (NCCL, fp32, tiny random models): needs a machine with two
GPUs, so it lives apart from tests/gpu (which runs on one):

  NCCL_NVLS_ENABLE=0 python -m pytest -q tests/gpu2

With tp_size 2 every rank captures the same CUDA graphs, which hold the all-reduces and the
vocabulary all-gather, and replays each graph rank 0 announces; greedy output equals tp=1's
plain decoding with no speculation, NGRAM, STANDALONE, EAGLE3 and NAIVE_EAGLE (rank 0's fused
verify-and-draft graphs, the workers replaying their verify graphs), for batches the graphs
hold and for a batch larger than them (eager, broadcast forwards).
"""
from __future__ import annotations

import pytest

from tests.fused_fixtures import fused_args, save_random_eagle_head
from tests.spec_fixtures import ngram_args, tiny_engine
from tests.test_tp_drafters import target  # noqa: F401  (fixture: the tiny Qwen2 the CPU TP tests use)
from tests.standalone_fixtures import make_noisy_draft, standalone_args

PROMPTS = [[5, 9, 13, 40, 2, 77], [7, 7, 8, 100, 3, 200, 7, 7, 8], [30, 31, 32, 33, 30, 31, 32],
           [100, 101] * 9, list(range(40, 60))]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
GRAPH_MAX_BS = 4   # the 5 prompts together run eagerly, fewer replay graphs
CUDA = {"device": "cuda", "cuda_graph_max_bs": GRAPH_MAX_BS, "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def expected(target) -> dict[str, list[list[int]]]:
    """tp=1 plain decoding, all prompts at once and one at a time (graphs)."""
    with tiny_engine(target, **CUDA) as engine:
        return {"batch": [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)],
                "single": [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS[:2]]}


def speculative_args(case: str, target: str, directory) -> dict:
    if case == "plain":
        return {}
    if case == "ngram":
        return ngram_args(6)
    if case == "standalone":
        return standalone_args(make_noisy_draft(target, directory, sigma=0.05), num_steps=3)
    save_random_eagle_head(target, directory, "EAGLE3")
    return fused_args("EAGLE3" if case == "eagle3" else "NAIVE_EAGLE", directory)


@pytest.mark.parametrize("case", ["plain", "ngram", "standalone", "eagle3", "naive_eagle"])
def test_greedy_output_with_graphs_on_two_gpus_equals_tp1(target, expected, tmp_path, case):
    with tiny_engine(target, tp_size=2, **CUDA, **speculative_args(case, target, tmp_path / "drafter")) as engine:
        assert engine.core.runner.graphs is not None
        if case == "naive_eagle":
            assert engine.core.drafter.fused.graphs is not None
        batch = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        single = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS[:2]]
    assert batch == expected["batch"] and single == expected["single"]
