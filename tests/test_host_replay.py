"""lab.host_replay: with the stand-in forwards installed the engine reproduces the recorded
greedy outputs exactly (plain and NGRAM, so verification accepts what the model would), the
replay reports host time per step for each configuration, and everything patched is put back.
A tiny random model on the CPU."""
from __future__ import annotations

import pytest
import torch

from lab.host_replay import ReplayForward, parse_config, replay
from lab.plain_step_host import PREFILL_MARGIN, DeviceTimeReplay, time_plain_steps
from specserve.bench.gpu_suite import set_drafter
from specserve.engine.overlap import OverlapSchedule
from specserve.speculative.adaptive.policy import MAX_PROBE_EVERY
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


def test_stand_in_follows_steps_launched_ahead(engine, recorded):
    """On the overlap schedule a step is launched before the previous one's tokens are
    committed: the stand-in reads its position from the KV length, not the output so far."""
    config = engine.core.runner.config
    stand_in = ReplayForward(PROMPTS, recorded, config.eos_token_ids[0], config.vocab_size)
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    engine.core.overlap = OverlapSchedule(engine.core.runner, engine.core.scheduler, engine.core.sampler)
    try:
        with stand_in.installed(engine.core.runner):
            for spec in (None, (8, False, True)):
                set_drafter(engine, *(spec or (None,)))
                assert [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)] == recorded
    finally:
        engine.core.overlap = None


def test_plain_step_host_times_the_plain_steps_of_both_engines(tmp_path_factory):
    """lab.plain_step_host: the batch stays whole while timed, the plain engine's steps are
    all plain, the speculative one probes (and says how often), and everything is put back."""
    path = tmp_path_factory.mktemp("tiny-plain-host")
    make_tiny_directory(path, "llama", seed=5)
    warm, steps = 4, MAX_PROBE_EVERY + 4   # k comes from measured host times (up to MAX_PROBE_EVERY): one probe at least
    with tiny_engine(path, **ngram_args(16)) as engine:
        set_drafter(engine, None)
        long = {"temperature": 0, "max_new_tokens": PREFILL_MARGIN + warm + steps + 1, "ignore_eos": True}
        outputs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS[:2], sampling_params=long)]
        engine.shutdown()   # the bench steps the core itself
        config = engine.core.runner.config
        stand_in = DeviceTimeReplay(PROMPTS[:2], outputs, config.eos_token_ids[0], config.vocab_size, step_s=1e-4)
        with stand_in.installed(engine.core.runner), torch.inference_mode():
            rows = [time_plain_steps(engine, stand_in, PROMPTS[:2], spec, warm, steps) for spec in (None, (8, False, True))]
        assert engine.core.overlap is None and not engine.core.has_work()
        assert stand_in.cpu_seconds > 0
    plain, spec = rows
    assert plain["engine"] == "plain" and plain["plain_steps"] == steps and plain["other_steps"] == 0
    assert spec["engine"] == "ngram-8-multi-adaptive" and spec["plain_steps"] + spec["other_steps"] == steps
    assert spec["probes"] >= 1 and spec["probe_every"] >= 1
    for row in rows:
        assert row["batch_size"] == 2 and row["host_us_per_plain_step_median"] > 0
