"""EngineCore.pipeline_for: which pipeline runs each step (engine/*_step.py). A prefill runs
PrefillStep; a greedy decode step on an engine that launches steps ahead runs PlainStep
without a drafter and DraftingStep with an n-gram drafter; so does a sampling step that samples
from the logits alone (on the device: the sampler's verify_on_device, sample_plain); one with a
penalty runs VerifyStep (verify_plain without drafts, verify with them). Outputs stay those of
the engine without the schedules that launch ahead."""
from __future__ import annotations

from collections import Counter

import pytest

from tests.spec_fixtures import make_tiny_directory, ngram_args, tiny_engine
from tests.test_draft_ahead import ahead_on

PROMPTS = [[5, 6, 7, 8, 9] * 4, [20, 21, 22, 23] * 5]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "seed": 7, "max_new_tokens": 12, "ignore_eos": True}
PENALISED = {**SAMPLED, "repetition_penalty": 1.2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_directory(path)
    return path


def kinds_run(engine, params: dict) -> tuple[Counter, list[list[int]]]:
    """How many steps each pipeline ran for PROMPTS under `params`, and the outputs."""
    core = engine.core
    names = {id(getattr(core, name)): name for name in ("prefill", "plain", "drafting", "verify", "verify_plain")}
    counted, pipeline_for = Counter(), core.pipeline_for

    def counting(batch):
        pipeline = pipeline_for(batch)
        counted[names[id(pipeline)]] += 1
        return pipeline
    core.pipeline_for = counting
    try:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    finally:
        del core.pipeline_for
    return counted, [o["output_ids"] for o in outputs]


def assert_decode_steps_ran(counted: Counter, kind: str) -> None:
    decode_steps = sum(n for name, n in counted.items() if name != "prefill")
    assert counted["prefill"] >= 1 and decode_steps >= 2 and counted[kind] == decode_steps, counted


# (speculation, sampling, the decode steps' pipeline launching nothing ahead, and launching ahead)
CASES = [({}, GREEDY, "verify_plain", "plain"), ({}, SAMPLED, "verify_plain", "plain"),
         ({}, PENALISED, "verify_plain", "verify_plain"),
         (ngram_args(4), GREEDY, "drafting", "drafting"), (ngram_args(4), SAMPLED, "drafting", "drafting"),
         (ngram_args(4), PENALISED, "verify", "verify")]


@pytest.mark.parametrize("speculation, params, kind, kind_ahead", CASES)
def test_each_step_runs_the_pipeline_of_its_kind(model_dir, speculation, params, kind, kind_ahead):
    with tiny_engine(model_dir, **speculation) as engine:
        counted, expected = kinds_run(engine, params)    # nothing launched ahead: a CPU engine's default
        assert_decode_steps_ran(counted, kind)
        counted, got = kinds_run(ahead_on(engine), params)
        assert_decode_steps_ran(counted, kind_ahead)
    assert got == expected
