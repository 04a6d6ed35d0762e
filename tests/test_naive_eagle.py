"""NAIVE_EAGLE and MTP (fused chains of one draft, speculative/model_drafters/fused_chain.py) and, for sampling,
EAGLE's fused chain of three: stops inside an accepted path are cut, sampling is lossless
(chi-square against the exact distribution, with a control that ignores q), also when there
is no q table and sampled drafts take the unfused chain; seeded requests get plain
decoding's tokens; both also with each step queued before the one before it is read
(chained, as on a GPU); the flags are checked. Greedy identity, the verify steps training
predicts and the KV accounting of every fused chain, K = 1 included: test_eagle_fused_chain.py.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.errors import ArgumentError
import specserve.speculative.model_drafters.fused_chain
import specserve.speculative.model_drafters.fused_step
from specserve.verify import rules
from tests.fused_fixtures import (FusedSpy, fused_args, save_random_eagle_head, save_random_mtp_head,
                                  wait_until_fused_state_is_free)
from tests.spec_fixtures import make_tiny_directory, plain_greedy_outputs, tiny_engine, truncated_mid_path
from tests.test_draft_ahead import ahead_on
from tests.test_eagle_drafter import head_dir, target  # noqa: F401  (a target and heads trained on it)
from tests.test_spec_sampling import PROMPT, SAMPLES, chi_square_p, exact_joint, exact_step_logits
from tests.test_spec_sampling import VOCAB as SAMPLING_VOCAB

GREEDY = {"temperature": 0.0, "max_new_tokens": 32}


@pytest.mark.parametrize("num_steps", [1, 3])
def test_stops_inside_an_accepted_path_are_cut(target, head_dir, num_steps):  # noqa: F811
    """Each answer stopped at its k-th token for several k (its token a stop token, earlier
    ones held back by min_new_tokens = k, which the engine verifies until it is reached),
    with NAIVE_EAGLE's chain of one draft and EAGLE's of three."""
    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    args = fused_args("NAIVE_EAGLE", head_path) if num_steps == 1 else \
        fused_args(algorithm, head_path, speculative_num_steps=num_steps)
    cases = [(c.tokens[:c.prompt_len], c.tokens[c.prompt_len:], k) for c in held_out for k in range(3, 12)
             if len(c.tokens) - c.prompt_len > k + 1]
    params = [{**GREEDY, "stop_token_ids": [answer[k]], "min_new_tokens": k} for _, answer, k in cases]
    prompts = [prompt for prompt, _, _ in cases]
    expected = plain_greedy_outputs(path, prompts, params)
    with tiny_engine(path, max_running_requests=1, **args) as engine:
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    assert any(truncated_mid_path(o) for o in outputs) and spy.fused > 0 and spy.engine > 0


# ---- sampling ----
@pytest.fixture(scope="module")
def sampling_target(tmp_path_factory):
    """test_spec_sampling's 16-token target and its exact joint distribution of four tokens."""
    target_path = tmp_path_factory.mktemp("naive-v16")
    hf_target = make_tiny_directory(target_path, "llama", vocab_size=SAMPLING_VOCAB, tokenizer="letters",
                                    weight_std=None, logit_scale=20.0)
    return target_path, exact_step_logits(hf_target.double())


@pytest.fixture(scope="module", params=["NAIVE_EAGLE", "MTP", "EAGLE-3-steps"])
def sampling_models(request, sampling_target, tmp_path_factory):
    """(target, the drafter's engine arguments, the target's step logits): an EAGLE head
    drafts over a subset of ids mapped to the target's (d2t), one draft per step (NAIVE_EAGLE)
    or a fused chain of three (EAGLE), an MTP layer over all ids."""
    target_path, step_logits = sampling_target
    head_path = tmp_path_factory.mktemp(f"v16-{request.param}")
    if request.param == "MTP":
        save_random_mtp_head(target_path, head_path, seed=3, std=0.1)
        return target_path, fused_args("MTP", head_path), step_logits
    save_random_eagle_head(target_path, head_path, algorithm="EAGLE", seed=3, draft_vocab=torch.arange(1, SAMPLING_VOCAB))
    if request.param == "NAIVE_EAGLE":
        return target_path, fused_args("NAIVE_EAGLE", head_path), step_logits
    return target_path, fused_args("EAGLE", head_path, speculative_num_steps=3), step_logits


class FusedVerifySpy:
    """The rules the fused steps verified sampled batches with."""

    def __init__(self, monkeypatch):
        self.rules = Counter()
        original = specserve.speculative.model_drafters.fused_step.verify_sampling

        def spy(trees, logits, *args, rule, **kwargs):
            self.rules[rule, args[-1] is not None] += 1     # the last positional argument: draft_probs
            return original(trees, logits, *args, rule=rule, **kwargs)
        monkeypatch.setattr(specserve.speculative.model_drafters.fused_step, "verify_sampling", spy)


def sample(models, config: dict, fused: bool = True, ahead: bool = False) -> list[dict]:
    """SAMPLES continuations of PROMPT; fused: every step was a fused one (else none was);
    ahead: steps launched ahead, as on a GPU (fused steps chained before the step before is read)."""
    target_path, args, _ = models
    params = [{**config, "max_new_tokens": 5, "ignore_eos": True} for _ in range(SAMPLES)]
    # KV for all 1024 running requests and their drafts (the CPU default is the model's
    # context); sampling under a pool that forces preemption: test_sampling_under_kv_pressure
    with tiny_engine(target_path, max_running_requests=1024, max_total_tokens=32768, **args) as engine:
        if ahead:
            ahead_on(engine)
        spy = FusedSpy(engine.core.drafter)
        sampler = engine.core.sampler   # the engine's own verification of a drafting step, on the device or after a read
        by_sampler, verify_on_device, sample_after_read = [], sampler.verify_on_device, sampler.sample
        sampler.verify_on_device = lambda *a: by_sampler.append(True) or verify_on_device(*a)
        sampler.sample = lambda logits, trees, *a: by_sampler.append(trees.tokens.shape[1] > 1) or sample_after_read(
            logits, trees, *a)
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    engine_verified = spy.engine > 0 or any(by_sampler)
    assert (not engine_verified and spy.fused > 0) if fused else (spy.fused == 0 and engine_verified)
    assert (spy.chained > 0) == (ahead and fused), vars(spy)
    return outputs


def accept_histogram(outputs: list[dict]) -> Counter:
    histogram = Counter()
    for output in outputs:
        histogram.update(output["meta_info"]["spec_accept_histogram"])
    return histogram


@pytest.mark.parametrize("ahead", [False, True], ids=["read", "chained"])
@pytest.mark.parametrize("config", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 4}], ids=str)
def test_samples_follow_the_exact_distribution(sampling_models, monkeypatch, config, ahead):
    """Each step proposed after the step before is read, or queued before it (chained): the
    same exact distribution."""
    spy = FusedVerifySpy(monkeypatch)
    outputs = sample(sampling_models, config, ahead=ahead)
    assert set(spy.rules) == {("rejection", True)}      # every step: residual rejection with q
    histogram = accept_histogram(outputs)
    assert histogram[2] > 0.1 * sum(histogram.values()), histogram      # drafts get accepted
    p = chi_square_p(outputs, exact_joint(sampling_models[2], **config))
    assert p > 1e-4, f"{config}: chi-square p = {p:.3g}"


def test_chi_square_catches_an_accept_rule_that_ignores_q(sampling_models, monkeypatch):
    def ignores_q(u, residual_x, residual_mass, draft_q_x):
        return u * residual_mass < residual_x
    monkeypatch.setattr(rules, "_accept", ignores_q)
    outputs = sample(sampling_models, {"temperature": 1.0})
    p = chi_square_p(outputs, exact_joint(sampling_models[2], temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a verifier that ignores q went unnoticed"


@pytest.mark.parametrize("ahead", [False, True], ids=["read", "chained"])
def test_seeded_requests_get_the_tokens_of_plain_decoding(sampling_models, monkeypatch, ahead):
    """A seed asks for plain decoding's tokens: argmax drafts and the coupled rule, whether a
    step is queued before the one before it is read (chained) or not. Requests of several
    lengths: chained steps continue for those the step before did not end."""
    target_path, args, _ = sampling_models
    prompts = [PROMPT[i:] for i in range(8)]
    params = [{"temperature": 1.0, "max_new_tokens": 8 + i, "ignore_eos": True, "seed": 100 + i} for i in range(8)]
    with tiny_engine(target_path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    spy = FusedVerifySpy(monkeypatch)
    with tiny_engine(target_path, **args) as engine:
        if ahead:
            ahead_on(engine)
        steps = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    assert set(spy.rules) == {("coupled", False)}
    assert max(accept_histogram(outputs)) > 1        # drafts were accepted
    assert (steps.chained > 0) == ahead, vars(steps)


def test_sampled_batches_their_fused_step_does_not_take_are_verified_by_the_sampler(sampling_models, monkeypatch):
    """Steps launched ahead, as on a GPU, where the fused step does not take every sampled
    batch (as where a head cache is full: here every batch whose tokens sum to a multiple of
    3): those are verified by the engine's sampler at once, with the q their drafts were
    drawn from; the samples keep the exact distribution, seeded requests plain decoding's
    tokens, and every slot comes back."""
    from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
    fuses = FusedChainDrafter._fuses
    monkeypatch.setattr(FusedChainDrafter, "_fuses",
                        lambda self, reqs: sum(r.num_tokens for r in reqs) % 3 != 0 and fuses(self, reqs))
    target_path, args, _ = sampling_models
    params = [{"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True}] * SAMPLES
    prompts = [PROMPT[i:] for i in range(8)]
    seeded = [{"temperature": 1.0, "max_new_tokens": 8 + i, "ignore_eos": True, "seed": 100 + i} for i in range(8)]
    with tiny_engine(target_path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=seeded)]
    with tiny_engine(target_path, max_running_requests=1024, max_total_tokens=32768, **args) as engine:
        ahead_on(engine)
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        assert [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=seeded)] == expected
        wait_until_fused_state_is_free(engine)
    assert spy.fused > 0 and spy.engine > 0 and spy.chained > 0, vars(spy)
    assert chi_square_p(outputs, exact_joint(sampling_models[2], temperature=1.0)) > 1e-4


def test_without_a_q_table_sampled_drafts_take_the_unfused_chain(sampling_models, monkeypatch):
    """A q table over the size limit: batches with sampled drafts are verified by the engine
    (EagleDrafter's chain hands its q over) and stay exact; seeded ones are still fused."""
    monkeypatch.setattr(specserve.speculative.model_drafters.fused_chain, "Q_TABLE_BYTES", 0)
    outputs = sample(sampling_models, {"temperature": 1.0}, fused=False)
    assert chi_square_p(outputs, exact_joint(sampling_models[2], temperature=1.0)) > 1e-4
    target_path, args, _ = sampling_models
    with tiny_engine(target_path, **args) as engine:
        assert engine.core.drafter.fused.q_table is None
        spy = FusedSpy(engine.core.drafter)
        engine.generate(input_ids=[PROMPT] * 4, sampling_params=[
            {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": i} for i in range(4)])
        wait_until_fused_state_is_free(engine)
    assert spy.fused > 0 and spy.engine == 0


# ---- flags ----
def test_flags_are_checked(target, head_dir, tmp_path):  # noqa: F811
    path = target[0]
    _, head_path, _, _ = head_dir
    for extra, field in (({"speculative_eagle_topk": 2}, "speculative_eagle_topk"),
                         ({"speculative_num_draft_tokens": 4}, "speculative_num_draft_tokens"),
                         ({"speculative_num_steps": 3}, "speculative_num_steps")):
        with pytest.raises(ArgumentError, match=field):
            tiny_engine(path, **fused_args("NAIVE_EAGLE", head_path, **extra))
    with pytest.raises(ArgumentError, match="speculative_draft_model_path"):
        tiny_engine(path, speculative_algorithm="NAIVE_EAGLE")
    with pytest.raises(ArgumentError, match="config.json"):
        tiny_engine(path, **fused_args("NAIVE_EAGLE", tmp_path))
    with tiny_engine(path, **fused_args("NAIVE_EAGLE", head_path, speculative_num_draft_tokens=2,
                                        speculative_num_steps=1, speculative_eagle_topk=1)) as engine:
        assert engine.core.num_draft_tokens == 2    # SGLang's spelling of the same chain
