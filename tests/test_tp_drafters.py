"""Model drafters with tensor parallelism on the CPU (gloo, 2 ranks): the drafter runs once, on
rank 0, with whole weights, and every rank verifies its trees.

Greedy output equals tp=1 plain decoding, and the drafts are tp=1's drafts, step after step:
the draft model (STANDALONE, a noisy copy of the target: drafts are accepted) or the head
(EAGLE3 / EAGLE, random heads) sees what it sees with one rank, i.e. whole target states
captured on rank 0 and the whole embedding gathered from the ranks' vocabulary shards (the
target's vocabulary is odd: the last shard has a padding row). The fused chain (NAIVE_EAGLE,
MTP) verifies on every rank; an MTP layer copied from a one-layer target (tests/test_mtp.py)
gets drafts accepted through the fused step with the borrowed lm_head and embedding
gathered whole.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from specserve.model.loader import load_checkpoint
from tests.fused_fixtures import FusedSpy, fused_args, save_random_eagle_head, wait_until_fused_state_is_free
from tests.spec_fixtures import ProposeSpy, make_tiny_directory, plain_greedy_outputs, tiny_engine
from tests.standalone_fixtures import make_noisy_draft, standalone_args, wait_until_draft_kv_is_free
from tests.test_mtp import PROMPTS as MTP_PROMPTS, copy_head, target_dir  # noqa: F401  (fixtures)
from tests.test_tensor_parallel import no_worker_outlives_the_tests  # noqa: F401  (autouse fixture)

PROMPTS = [[5, 9, 13, 40, 2, 77], [7, 7, 8, 100, 3, 200, 7, 7, 8], [30, 31, 32, 33, 30, 31, 32]]
GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    """Qwen2, 4 heads and 2 KV heads, a 255-token vocabulary (128 rows per rank, one padding)."""
    path = tmp_path_factory.mktemp("tp-drafter-target")
    make_tiny_directory(path, "qwen2", vocab_size=255)
    return str(path)


@pytest.fixture(scope="module")
def plain_outputs(target) -> list[list[int]]:
    return plain_greedy_outputs(target, PROMPTS, GREEDY)


def drafter_args(algorithm: str, target: str, directory) -> dict:
    if algorithm == "STANDALONE":
        return standalone_args(make_noisy_draft(target, directory, sigma=0.05), num_steps=3)
    save_random_eagle_head(target, directory, algorithm)
    return {**fused_args(algorithm, directory), "speculative_num_steps": 3}


def generate(target: str, tp_size: int, args: dict) -> tuple[list[dict], list, object]:
    """Outputs, every tree the drafter proposed, and the drafter's head or draft model."""
    with tiny_engine(target, tp_size=tp_size, **args) as engine:
        drafter = engine.core.drafter
        spy = ProposeSpy(drafter)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        if args["speculative_algorithm"] == "STANDALONE":
            wait_until_draft_kv_is_free(engine)
        return outputs, spy.trees, drafter.runner


@pytest.mark.parametrize("algorithm", ["STANDALONE", "EAGLE3", "EAGLE"])
def test_drafts_and_greedy_output_are_tp1s(target, plain_outputs, tmp_path, algorithm):
    args = drafter_args(algorithm, target, tmp_path / "drafter")
    one_rank, one_rank_trees, _ = generate(target, 1, args)
    outputs, trees, runner = generate(target, 2, args)
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in one_rank] == plain_outputs
    assert trees == one_rank_trees and sum(len(tokens) > 1 for tokens, _ in trees) > 10
    if algorithm == "STANDALONE":   # paths of accepted drafts were committed on both ranks
        assert any(length > 1 for o in outputs for length in o["meta_info"]["spec_accept_histogram"])
    else:
        whole = load_checkpoint(target, torch.float32).state_dict["model.embed_tokens.weight"]
        assert torch.equal(runner.head.embed_tokens.weight, whole)


def test_naive_eagle_fused_steps_run_on_every_rank(target, plain_outputs, tmp_path):
    save_random_eagle_head(target, tmp_path / "head", "EAGLE3")
    with tiny_engine(target, tp_size=2, **fused_args("NAIVE_EAGLE", tmp_path / "head")) as engine:
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == plain_outputs
    assert spy.fused > 0 and spy.engine == 0


def test_mtp_layer_borrows_whole_vocabulary_weights_and_gets_drafts_accepted(target_dir, copy_head):  # noqa: F811
    expected = plain_greedy_outputs(target_dir, MTP_PROMPTS, GREEDY)
    whole = load_checkpoint(str(target_dir), torch.float32).state_dict
    with tiny_engine(target_dir, tp_size=2, **fused_args("MTP", copy_head)) as engine:
        head = engine.core.drafter.runner.head
        assert torch.equal(head.borrowed.lm_head, whole["lm_head.weight"])
        assert torch.equal(head.embed_tokens.weight, whole["model.embed_tokens.weight"])
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=MTP_PROMPTS, sampling_params=GREEDY)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    histogram = Counter()
    for output in outputs:
        histogram.update(output["meta_info"]["spec_accept_histogram"])
    assert spy.fused > 0 and histogram[2] > 0 and histogram[1] > 0   # drafts accepted and rejected


def test_check_identity_runs_every_case_it_names(tmp_path, capsys):
    """The 2-GPU command's own code path (on the CPU: no graphs), with the random EAGLE3 head it
    writes for the target; the sample prompts are text (a vocabulary that holds the tokenizer's ids)."""
    from lab.check_identity import main
    make_tiny_directory(tmp_path, "qwen2", vocab_size=288)
    main(["--model-path", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
          "--tp-size", "2", "--max-new-tokens", "8", "--cases", "plain,standalone,naive_eagle"])
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["case"], r["speculative_algorithm"]) for r in reports] == [
        ("plain", None), ("standalone", "STANDALONE"), ("naive_eagle", "NAIVE_EAGLE")]
    assert all(r["requests_identical"] == 1.0 and r["divergences"] == [] for r in reports), reports
