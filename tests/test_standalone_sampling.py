"""STANDALONE sampling is lossless: drafts sampled from the draft model's distribution q are
verified by residual rejection with q (accept with min(1, p/q), resample from
norm(max(p - q, 0))), and the first four tokens of thousands of unseeded requests follow
the exact target distribution (chi-square; the distribution enumerated over all 16**4
continuations with transformers in float64, as tests/test_spec_sampling.py does).

The target is a random model over a 16-token vocabulary; the draft is a noisy copy of it,
so q is close to p but not equal. A verifier that ignores q fails the same test (power),
and seeded requests, verified with the coupled rule, get plain decoding's tokens.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import specserve.sampling.sampler
from specserve.verify import rules
from tests.spec_fixtures import make_tiny_directory, tiny_engine, wait_until_all_kv_is_free
from tests.test_spec_sampling import (  # the same prompt, vocabulary and exact joint distribution
    PROMPT, SAMPLES, VOCAB, chi_square_p, exact_joint, exact_step_logits)
from tests.standalone_fixtures import make_noisy_draft, standalone_args, wait_until_draft_kv_is_free

MAX_NEW_TOKENS = 5        # the prefill's token, then a chain of 3 drafts verified (up to 4 tokens)
NUM_STEPS = 3
CONFIGS = {"temperature 1": {"temperature": 1.0}, "temperature 0.8 top_k 4": {"temperature": 0.8, "top_k": 4}}
ALPHA = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("standalone-v16")
    # HF's small init with lm_head scaled up: a few hundred continuations carry most of the mass
    hf_target = make_tiny_directory(target, "llama", vocab_size=VOCAB, tokenizer="letters", weight_std=None,
                                    logit_scale=20.0)
    draft = make_noisy_draft(target, tmp_path_factory.mktemp("standalone-v16-draft"), sigma=0.004)
    return target, draft, hf_target.double()


@pytest.fixture(scope="module")
def step_logits(models) -> list[torch.Tensor]:
    return exact_step_logits(models[2])


def sample(models, config: dict, seeded: bool = False, **engine_args) -> list[dict]:
    target, draft, _ = models
    # KV for all 1024 running requests and their drafts (the CPU default is the model's
    # context); sampling under a pool that forces preemption: test_sampling_under_kv_pressure
    with tiny_engine(target, **standalone_args(draft, NUM_STEPS), max_running_requests=1024, max_total_tokens=32768,
                     **engine_args) as engine:
        params = [{**config, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, **({"seed": i} if seeded else {})}
                  for i in range(SAMPLES)]
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        wait_until_draft_kv_is_free(engine)
        wait_until_all_kv_is_free(engine)
    return outputs


class VerifySpy:
    """Counts the verify_sampling calls of steps with drafts, by whether they had q."""

    def __init__(self, monkeypatch):
        self.with_q = self.without_q = 0
        original = specserve.sampling.sampler.verify_sampling

        def spy(trees, logits, *args, draft_probs=None, rule="coupled", **kwargs):
            if draft_probs is not None:
                assert rule == "rejection" and draft_probs.shape[:2] == trees.tokens.shape
                self.with_q += 1
            elif trees.num_slots > 1:   # not a prefill's first token, nor a step without drafts
                self.without_q += 1
            return original(trees, logits, *args, draft_probs=draft_probs, rule=rule, **kwargs)
        monkeypatch.setattr(specserve.sampling.sampler, "verify_sampling", spy)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_samples_follow_the_exact_distribution(models, step_logits, monkeypatch, name):
    spy = VerifySpy(monkeypatch)
    outputs = sample(models, CONFIGS[name])
    assert spy.with_q > 0 and spy.without_q == 0     # every verify step had q
    histogram = Counter()
    for out in outputs:
        histogram.update(out["meta_info"]["spec_accept_histogram"])
    steps = sum(histogram.values())
    assert histogram[1] < 0.7 * steps and histogram[NUM_STEPS + 1] > 0.05 * steps, histogram   # drafts accepted
    p = chi_square_p(outputs, exact_joint(step_logits, **CONFIGS[name]))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"


def test_chi_square_catches_an_accept_rule_that_ignores_q(models, step_logits, monkeypatch):
    """Sampled drafts accepted with probability r(x) instead of min(1, r(x) / q(x)): biased."""
    def ignores_q(u, residual_x, residual_mass, draft_q_x):
        return u * residual_mass < residual_x
    monkeypatch.setattr(rules, "_accept", ignores_q)
    outputs = sample(models, CONFIGS["temperature 1"])
    p = chi_square_p(outputs, exact_joint(step_logits, temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a verifier that ignores q went unnoticed"


def test_seeded_requests_get_the_tokens_of_plain_decoding(models):
    """A seed asks for plain decoding's tokens: argmax drafts, the coupled rule, no q."""
    config = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    prompts = [PROMPT[i:] for i in range(8)]
    params = [{**config, "seed": 100 + i} for i in range(len(prompts))]
    target, draft, _ = models
    with tiny_engine(target) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    with tiny_engine(target, **standalone_args(draft, NUM_STEPS)) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        wait_until_draft_kv_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    assert sum(o["meta_info"]["spec_accept_length"] for o in outputs) / len(outputs) > 1.3
