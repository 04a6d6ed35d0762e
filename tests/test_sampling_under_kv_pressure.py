"""Sampled model drafts under KV pressure: lossless, and still drafted.

With a small KV pool (the CPU default, 4096 tokens, for 1024 running requests of one shared
prompt), requests are preempted and resumed and drafts are cut to the room left; the first
four tokens of thousands of unseeded requests still follow the exact target distribution
(chi-square, tests/test_spec_sampling.py), for a draft model (STANDALONE) and the fused
chains of EAGLE heads and MTP. Preemption is forced on requests partway through those four
tokens (the scheduler's own preempt, at its schedule), so the resumed path is what is
tested; a verifier that ignores q fails the same test (power).

Admission leaves each running request room for its draft nodes in the target's pool and, for
a draft model, for its sequence in the draft model's own cache (which shares no prefix):
without that, a batch that shared its prompt filled the pools and decoded one token a step.
"""
from __future__ import annotations

from collections import Counter

from specserve.speculative.adaptive.draft_cuts import fit_to_free_slots
from specserve.verify import rules
from tests.fused_fixtures import wait_until_fused_state_is_free
from tests.spec_fixtures import tiny_engine, wait_until_all_kv_is_free
from tests.standalone_fixtures import standalone_args, wait_until_draft_kv_is_free
from tests.test_naive_eagle import accept_histogram, sampling_models, sampling_target  # noqa: F401  (V16 target, heads)
from tests.test_spec_sampling import NEW_TOKENS, PROMPT, SAMPLES, chi_square_p, exact_joint
from tests.test_standalone_sampling import models, step_logits  # noqa: F401  (V16 target, noisy draft)

PREEMPT_PER_STEP = 64    # running requests preempted at each schedule, partway through the tested tokens


def preempt_partway(scheduler) -> Counter:
    """Before each schedule, preempts up to PREEMPT_PER_STEP running requests (newest first)
    that decode, have committed 1 .. NEW_TOKENS - 1 tokens and were never preempted (so
    every request finishes). Returns the count of forced preemptions (updated as it runs)."""
    forced = Counter()
    original = scheduler.schedule

    def schedule():
        victims = [r for r in reversed(scheduler.running) if r.preemptions == 0
                   and 1 <= len(r.output_ids) < NEW_TOKENS and r.kv_len == r.num_tokens - 1]
        for req in victims[:PREEMPT_PER_STEP]:
            scheduler.preempt(req)
            forced["requests"] += 1
        return original()
    scheduler.schedule = schedule
    return forced


def sample_under_pressure(target, drafter_args: dict, forced_preemption: bool = True) -> list[dict]:
    """SAMPLES continuations of PROMPT at temperature 1 with the CPU default pool."""
    params = [{"temperature": 1.0, "max_new_tokens": NEW_TOKENS + 1, "ignore_eos": True}] * SAMPLES
    with tiny_engine(target, max_running_requests=1024, **drafter_args) as engine:
        assert engine.core.runner.pool.size <= 4096
        forced = preempt_partway(engine.core.scheduler) if forced_preemption else None
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        if hasattr(engine.core.drafter, "pending"):   # a fused chain drafter
            wait_until_fused_state_is_free(engine)
        else:
            wait_until_draft_kv_is_free(engine)
            wait_until_all_kv_is_free(engine)
    if forced is not None:
        assert forced["requests"] >= SAMPLES // 5, forced
        assert sum(o["meta_info"]["preemptions"] > 0 for o in outputs) >= forced["requests"]
    return outputs


def assert_drafts_accepted(outputs: list[dict]) -> None:
    histogram = accept_histogram(outputs)
    assert histogram[1] < 0.7 * sum(histogram.values()), histogram


def test_fit_to_free_slots_keeps_every_root_and_shares_the_rest():
    assert fit_to_free_slots([4, 4, 4], 12) == [4, 4, 4]
    assert fit_to_free_slots([4, 4, 4], 8) == [3, 3, 2]
    assert fit_to_free_slots([4, 1, 4], 5) == [2, 1, 2]
    assert fit_to_free_slots([4, 4], 2) == [1, 1]


def test_standalone_samples_follow_the_exact_distribution(models, step_logits):  # noqa: F811
    target, draft, _ = models
    outputs = sample_under_pressure(target, standalone_args(draft, 3))
    assert_drafts_accepted(outputs)
    p = chi_square_p(outputs, exact_joint(step_logits, temperature=1.0))
    assert p > 1e-4, f"chi-square p = {p:.3g}"


def test_standalone_drafts_without_preemption_in_the_default_pool(models):  # noqa: F811
    """The batch the target's prefix cache fits is kept to what the draft model's cache holds."""
    target, draft, _ = models
    assert_drafts_accepted(sample_under_pressure(target, standalone_args(draft, 3), forced_preemption=False))


def test_fused_samples_follow_the_exact_distribution(sampling_models):  # noqa: F811
    target, args, logits = sampling_models
    outputs = sample_under_pressure(target, args)
    histogram = accept_histogram(outputs)
    assert histogram[2] > 0.1 * sum(histogram.values()), histogram      # drafts get accepted
    p = chi_square_p(outputs, exact_joint(logits, temperature=1.0))
    assert p > 1e-4, f"chi-square p = {p:.3g}"


def ignore_q(monkeypatch) -> None:
    """Sampled drafts accepted with probability r(x) instead of min(1, r(x) / q(x)): biased."""
    def ignores_q(u, residual_x, residual_mass, draft_q_x):
        return u * residual_mass < residual_x
    monkeypatch.setattr(rules, "_accept", ignores_q)


def test_chi_square_catches_a_standalone_rule_that_ignores_q(models, step_logits, monkeypatch):  # noqa: F811
    ignore_q(monkeypatch)
    target, draft, _ = models
    p = chi_square_p(sample_under_pressure(target, standalone_args(draft, 3)), exact_joint(step_logits, temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a verifier that ignores q went unnoticed"


def test_chi_square_catches_a_fused_rule_that_ignores_q(sampling_models, monkeypatch):  # noqa: F811
    ignore_q(monkeypatch)
    target, args, logits = sampling_models
    p = chi_square_p(sample_under_pressure(target, args), exact_joint(logits, temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a verifier that ignores q went unnoticed"
