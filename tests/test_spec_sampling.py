"""Speculative sampling through the Engine is lossless: on a random-weight model with a
16-token vocabulary, the first four tokens sampled with NGRAM draft trees follow the exact
target distribution, computed by enumerating all 16**4 continuations with transformers
(float64) and the SamplingParams order (penalties -> temperature -> softmax -> top-k ->
top-p -> renormalise), checked with a chi-square test over thousands of seeded requests.

Each request makes five tokens: the first comes from the prefill, the others from verify
steps whose trees (up to 3 draft nodes; BFS breadth 2, so roots with two children and a
grandchild, or chains where the trie knows one continuation) the shared trie proposes, fed
by the repetitive prompt and by every request's output. The marginal of the first four is
tested: it covers a whole first verify step, however many of its drafts were accepted.

The engine verifies with the coupled rule (its default: a seeded request gets plain
decoding's tokens); residual rejection (rule "rejection") is tested at temperature 1 too.

Controls show the test has power: the same samples are rejected against a slightly
different distribution (temperature 1.3), and engines with a biased accept rule (either
rule), or with penalties that ignore a node's draft ancestors, fail it.
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
import scipy.stats
import torch
import transformers

from specserve.verify import random as srandom
from specserve.verify.filters import apply_penalties
import specserve.sampling.sampler
from specserve.verify import rules
from tests.spec_fixtures import ProposeSpy, make_tiny_directory, ngram_args, tiny_engine, wait_until_all_kv_is_free

VOCAB = 16
NEW_TOKENS = 4                        # tokens whose joint distribution is tested
MAX_NEW_TOKENS = 5                    # so that the first verify step drafts 3 nodes
SAMPLES = 4000                        # requests per configuration
PROMPT = [3, 4, 5, 6, 7, 8] * 3 + [3, 4]
CONFIGS = {
    "temperature 1": {"temperature": 1.0},
    "temperature 0.8 top_p 0.9": {"temperature": 0.8, "top_p": 0.9},
    "temperature 0.8 top_k 4": {"temperature": 0.8, "top_k": 4},
    # a penalty at a tree node counts the draft tokens of its ancestors
    "penalties": {"temperature": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.6, "presence_penalty": 0.4},
}
ALPHA = 1e-4                          # seeds are fixed, but drafts depend on batch timing: p varies a little


# ---- the exact target distribution ----
def filtered(logits: torch.Tensor, temperature: float, top_k: int = -1,
             top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities (..., V) as SamplingParams define them, written out independently of
    specserve.verify.filters, and a (...) mask of the rows whose top-k / top-p boundary is a
    near-tie that float32 could decide differently."""
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    near_tie = torch.zeros(logits.shape[:-1], dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        keep[..., top_k:] = False
        near_tie |= sorted_probs[..., top_k - 1] - sorted_probs[..., top_k] < 1e-5
    if top_p < 1.0:
        kept = torch.where(keep, sorted_probs, 0.0)
        before = (kept.cumsum(-1) - kept) / kept.sum(-1, keepdim=True)     # mass of the tokens ranked higher
        keep &= before < top_p
        keep[..., 0] = True
        near_tie |= ((before - top_p).abs() < 1e-5).any(-1)
    probs = torch.where(torch.empty_like(keep).scatter_(-1, order, keep), probs, 0.0)
    return probs / probs.sum(-1, keepdim=True), near_tie


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-v16")
    # HF's small init, lm_head scaled up: next-token entropy ~1.5 nats, so a few hundred of the
    # 65536 continuations carry most of the mass and drafts are often right
    model = make_tiny_directory(path, "llama", vocab_size=VOCAB, tokenizer="letters", weight_std=None, logit_scale=20.0)
    return path, model.double()


@pytest.fixture(scope="module")
def step_logits(model_dir) -> list[torch.Tensor]:
    return exact_step_logits(model_dir[1])


def exact_step_logits(model) -> list[torch.Tensor]:
    """[k]: (V,) * k + (V,) float64 logits of token k+1 given the prompt and tokens 1..k (an HF model)."""
    prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW_TOKENS - 1)))   # (V**3, 3)
    # the prompt once, its KV copied to every prefix: an eighth of the tokens of V**3 whole sequences
    # (10 s a module on one core, now ~1), the same logits. The cache goes positionally: its keyword
    # was renamed (past_key_values, then cache) across the transformers versions the dev extra allows
    cache = transformers.DynamicCache()
    with torch.no_grad():
        first = model(torch.tensor([PROMPT]), None, None, cache).logits[:, -1:]
        cache.batch_repeat_interleave(len(prefixes))
        logits = torch.cat([first.expand(len(prefixes), -1, -1), model(prefixes, None, None, cache).logits],
                           dim=1)                                                           # (V**3, 4, V)
    shape = (VOCAB,) * (NEW_TOKENS - 1)
    # token k+1 depends on x1..xk only: keep those axes, take the rest at 0
    return [logits[:, k].reshape(*shape, VOCAB)[(slice(None),) * k + (0,) * (NEW_TOKENS - 1 - k)]
            for k in range(NEW_TOKENS)]


def penalized(logits: torch.Tensor, repetition_penalty: float = 1.0, frequency_penalty: float = 0.0,
              presence_penalty: float = 0.0) -> torch.Tensor:
    """Penalties on (V,) * k + (V,) logits of token k+1, for every context x1..xk (the axes):
    repetition for tokens of the prompt or the output so far (logit / r if > 0, else * r),
    frequency and presence for output tokens (logit -= f * count + p * (count > 0))."""
    k = logits.dim() - 1
    counts = torch.zeros_like(logits)
    for axis in range(k):                        # counts[x1..xk, v] = #{j : x_j = v}
        counts = counts + torch.eye(VOCAB, dtype=logits.dtype).reshape([1] * axis + [VOCAB] + [1] * (k - axis - 1) + [VOCAB])
    in_prompt = torch.zeros(VOCAB, dtype=torch.bool)
    in_prompt[PROMPT] = True
    seen = (counts > 0) | in_prompt
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty), logits)
    return logits - frequency_penalty * counts - presence_penalty * (counts > 0).to(logits.dtype)


def exact_joint(step_logits: list[torch.Tensor], temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0,
                **penalties) -> torch.Tensor:
    """(V,) * 4: P(x1, x2, x3, x4) = prod_k p_k(x_k | prompt, x_<k), each p_k penalised and filtered."""
    joint, near_tie_mass = torch.ones(()), 0.0
    for logits in step_logits:
        probs, near_tie = filtered(penalized(logits, **penalties), temperature, top_k, top_p)
        near_tie_mass += joint[near_tie].sum().item()      # the chance a sample passes a near-tie
        joint = joint.unsqueeze(-1) * probs
    assert abs(joint.sum().item() - 1) < 1e-9
    assert near_tie_mass * SAMPLES < 0.01, "filter boundaries float32 may decide otherwise get sampled"
    return joint


# ---- samples through the engine ----
def sample(path, configs: list[dict], rule: str = "coupled") -> tuple[list[dict], ProposeSpy]:
    """SAMPLES seeded requests per configuration, all in one generate call, verified with `rule`."""
    # a pinned draft size (ngram_args' default): every verify step drafts what the trie offers
    drafter = ngram_args(4, speculative_ngram_min_bfs_breadth=2, speculative_ngram_max_bfs_breadth=2)
    # KV for all 1024 running requests and their drafts: with a fuller pool the engine cuts drafts
    with tiny_engine(path, **drafter, max_running_requests=1024, max_total_tokens=32768) as engine:
        engine.core.sampler.sampling_rule = rule
        spy = ProposeSpy(engine.core.drafter)
        params = [{**config, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "seed": SAMPLES * c + i}
                  for c, config in enumerate(configs) for i in range(SAMPLES)]
        outputs = engine.generate(input_ids=[PROMPT] * len(params), sampling_params=params)
        wait_until_all_kv_is_free(engine)
    return outputs, spy


@pytest.fixture(scope="module")
def samples(model_dir) -> dict:
    outputs, spy = sample(model_dir[0], list(CONFIGS.values()))
    by_config = {name: outputs[c * SAMPLES:(c + 1) * SAMPLES] for c, name in enumerate(CONFIGS)}
    return {"outputs": by_config, "spy": spy}


def chi_square_p(outputs: list[dict], joint: torch.Tensor) -> float:
    counts = Counter(tuple(out["output_ids"][:NEW_TOKENS]) for out in outputs)
    assert all(len(key) == NEW_TOKENS for key in counts)
    impossible = {key: n for key, n in counts.items() if joint[key] == 0}
    assert not impossible, f"sampled continuations the filters exclude: {impossible}"
    expected = joint.flatten() * len(outputs)
    observed = torch.zeros_like(expected)
    for key, n in counts.items():
        observed[torch.tensor(key) @ (VOCAB ** torch.arange(NEW_TOKENS - 1, -1, -1))] += n
    big = expected >= 5     # merge the cells expected fewer than 5 times into one
    f_exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    f_obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    assert big.sum() >= 50, "too few cells for a meaningful test"
    return scipy.stats.chisquare(f_obs.numpy(), f_exp.numpy()).pvalue


def depth_of(parents: list[int]) -> list[int]:
    depth = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return depth


def test_drafts_were_proposed_and_accepted(samples):
    spy = samples["spy"]
    histogram = Counter()
    for outputs in samples["outputs"].values():
        for out in outputs:
            assert len(out["output_ids"]) == MAX_NEW_TOKENS
            assert out["meta_info"]["spec_verify_ct"] >= 1
            histogram.update(out["meta_info"]["spec_accept_histogram"])
    steps = sum(histogram.values())
    assert spy.drafted_nodes > steps          # on average more than one draft node per verify step
    deep = sum(max(depth_of(parents)) >= 2 for _, parents in spy.trees)
    assert spy.branching_trees > 0.05 * len(spy.trees) and deep > 0.05 * len(spy.trees)
    assert histogram[1] < 0.8 * steps and histogram[3] + histogram[4] > 0.02 * steps, histogram


@pytest.mark.parametrize("name", list(CONFIGS))
def test_samples_follow_the_exact_distribution(samples, step_logits, name):
    p = chi_square_p(samples["outputs"][name], exact_joint(step_logits, **CONFIGS[name]))
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"


def test_chi_square_has_power(samples, step_logits):
    """Temperature-1 samples against the temperature-1.3 distribution: clearly rejected."""
    p = chi_square_p(samples["outputs"]["temperature 1"], exact_joint(step_logits, temperature=1.3))
    assert p < 1e-6, f"p = {p:.3g}: the test cannot tell temperature 1 from 1.3"


def test_rejection_rule_samples_follow_the_exact_distribution(model_dir, step_logits):
    outputs, _ = sample(model_dir[0], [CONFIGS["temperature 1"]], rule="rejection")
    p = chi_square_p(outputs, exact_joint(step_logits, temperature=1.0))
    assert p > ALPHA, f"residual rejection: chi-square p = {p:.3g}"


def test_chi_square_catches_a_biased_rejection_rule(model_dir, step_logits, monkeypatch):
    """The engine with a subtly wrong residual-rejection verifier (drafts accepted with
    probability min(1, 1.3 r(x)) instead of r(x)) fails the same test: the drafts really go
    through verification here."""
    def biased(u, residual_x, residual_mass, draft_q_x):
        return u * residual_mass < 1.3 * residual_x
    monkeypatch.setattr(rules, "_accept", biased)
    outputs, _ = sample(model_dir[0], [CONFIGS["temperature 1"]], rule="rejection")
    p = chi_square_p(outputs, exact_joint(step_logits, temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a biased accept rule went unnoticed"


def test_chi_square_catches_a_coupled_rule_that_reuses_the_root_position(model_dir, step_logits, monkeypatch):
    """The engine with a subtly wrong coupled verifier (every node of a tree decided with the
    random numbers of the root's position, so the tokens of an accepted path share them) fails
    the same test."""
    race = srandom.exponential_race

    def root_position_race(probs, seeds, positions, salt=srandom.SALT_TOKEN):
        return race(probs, seeds, positions[:, :1].expand_as(positions), salt)
    monkeypatch.setattr(rules, "exponential_race", root_position_race)
    outputs, _ = sample(model_dir[0], [CONFIGS["temperature 1"]])
    p = chi_square_p(outputs, exact_joint(step_logits, temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a coupled rule with shared noise went unnoticed"


def test_chi_square_catches_penalties_that_ignore_draft_ancestors(model_dir, step_logits, monkeypatch):
    """Penalties computed from the committed tokens only (a tree node not counting its draft
    ancestors) fail the penalties test: accepted drafts really are penalised here."""
    def committed_counts_only(logits, trees, base_counts, prompt_mask, repetition, frequency, presence):
        return apply_penalties(logits, base_counts.unsqueeze(1), prompt_mask.unsqueeze(1), repetition, frequency, presence)
    monkeypatch.setattr(specserve.sampling.sampler, "apply_penalties_to_tree", committed_counts_only)
    outputs, _ = sample(model_dir[0], [CONFIGS["penalties"]])
    p = chi_square_p(outputs, exact_joint(step_logits, **CONFIGS["penalties"]))
    assert p < 1e-6, f"p = {p:.3g}: penalties that ignore the draft ancestors went unnoticed"
