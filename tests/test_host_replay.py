"""bench.host_replay: with the stand-in forwards installed the engine reproduces the recorded
greedy outputs exactly (plain and NGRAM, so verification accepts what the model would), the
replay reports host time per step for each configuration, and everything patched is put back.
A tiny random model on the CPU."""
from __future__ import annotations

import pytest
import torch

from specserve.bench.gpu_suite import set_drafter
from specserve.bench.host_replay import ReplayForward, parse_config, replay
from tests.spec_fixtures import make_tiny_directory, ngram_args, tiny_engine

PROMPTS = [[5, 6, 7, 8, 9] * 6, [20, 21, 22, 23] * 5, list(range(30, 60)), [200, 201, 202] * 8]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-replay")
    make_tiny_directory(path, "llama", seed=4)
    with tiny_engine(path, **ngram_args(16)) as engine:
        yield engine


@pytest.fixture(scope="module")
def recorded(engine) -> list[list[int]]:
    set_drafter(engine, None)
    return [o["output_ids"] for o in engine.generate(
        input_ids=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS})]


def test_parse_config():
    assert parse_config("plain") is None
    assert parse_config("8-multi") == (8, False, False)
    assert parse_config("4-one") == (4, True, False)
    assert parse_config("16-multi-adaptive") == (16, False, True)


def test_stand_in_reproduces_the_model_and_is_put_back(engine, recorded):
    runner = engine.core.runner
    originals = (runner.extend, runner.run_trees, torch.Tensor.argmax)
    config = runner.config
    stand_in = ReplayForward(PROMPTS, recorded, config.eos_token_ids[0], config.vocab_size)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    with stand_in.installed(runner):
        for spec in (None, (8, False, False), (4, True, False)):
            set_drafter(engine, *(spec or (None,)))
            for _ in range(2):  # the second time drafts from the first's outputs: long accepted paths
                assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)] == recorded
    assert stand_in.seconds > 0
    assert (runner.extend, runner.run_trees, torch.Tensor.argmax) == originals


def test_replay_reports_host_time_per_configuration(engine, recorded):
    rows = replay(engine, PROMPTS, recorded, ["plain", "8-multi", "4-one"], 2, NEW_TOKENS, turns=2)
    assert [(r["config"], r["turn"]) for r in rows] == [(c, t) for c in ("plain", "8-multi", "4-one") for t in (1, 2)]
    for row in rows:
        assert row["output_tokens"] == sum(len(o) for o in recorded)
        assert row["decode_steps"] > 0 and row["host_ms_per_step"] > 0 and 1 <= row["mean_batch_size"] <= 2
    by_run = {(r["config"], r["turn"]): r for r in rows}
    assert by_run[("plain", 1)]["accept_length"] == 1.0
    assert by_run[("8-multi", 2)]["accept_length"] > 2          # the trie knows the first turn's outputs
    assert by_run[("8-multi", 2)]["decode_steps"] < by_run[("plain", 2)]["decode_steps"]
