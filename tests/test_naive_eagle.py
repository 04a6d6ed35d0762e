"""NAIVE_EAGLE (and, for sampling, MTP) through the Engine: one draft per step, verified and drafted again in one
fused step (runner/fused_chain.py). With heads our trainer made (tests/test_eagle_drafter.py's
fixtures, both kinds), greedy output equals plain decoding and every request's verify steps
are exactly those the trainer's accept-length replay predicts for chains of one draft,
at several batch sizes: which holds only if the fused step feeds the head the rows, target
states, tokens and positions training does, after accepted and rejected drafts alike.
Sampling is lossless (chi-square against the exact distribution, with a control that
ignores q), seeded requests get plain decoding's tokens, batches the fused step does not
serve (penalties, logprobs) are verified by the engine, and every target and head KV slot
comes back however requests end (finish, stop mid-path, abort, preemption).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import specserve.runner.fused_chain
from specserve.errors import ArgumentError
from specserve.speculative import verify
from specserve.speculative.eagle_batches import BatchBuilder
from specserve.speculative.eagle_eval import accepted_runs, replay_decoding
from tests.fused_fixtures import (FusedSpy, fused_args, save_random_eagle_head, save_random_mtp_head,
                                  wait_until_fused_state_is_free)
from tests.spec_fixtures import make_tiny_directory, plain_greedy_outputs, tiny_engine, truncated_mid_path
from tests.test_eagle_drafter import head_dir, target  # noqa: F401  (a target and heads trained on it)
from tests.test_spec_sampling import PROMPT, SAMPLES, chi_square_p, exact_joint, exact_step_logits
from tests.test_spec_sampling import VOCAB as SAMPLING_VOCAB

GREEDY = {"temperature": 0.0, "max_new_tokens": 32}


@pytest.mark.parametrize("max_running", [1, 3, 8])
def test_greedy_verify_steps_are_what_training_predicts(target, head_dir, max_running):  # noqa: F811
    path, _, _, held_out = target
    algorithm, head_path, head, extractor = head_dir
    with tiny_engine(path, max_running_requests=max_running, **fused_args("NAIVE_EAGLE", head_path)) as engine:
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=[c.tokens[:c.prompt_len] for c in held_out], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outputs] == [c.tokens[c.prompt_len:] for c in held_out]
        wait_until_fused_state_is_free(engine)
    assert spy.engine == 0 and spy.fused == sum(o["meta_info"]["spec_verify_ct"] for o in outputs)
    # one catch-up per request that decodes at all, then every draft came from a fused step
    assert spy.first_drafts == sum(o["meta_info"]["spec_verify_ct"] > 0 for o in outputs)
    batch = BatchBuilder(extractor, None, bool(head.config.aux_layers))(held_out).conversations
    with torch.no_grad():
        runs = accepted_runs(head, batch, 1).cpu()
    for row, (conversation, output) in enumerate(zip(held_out, outputs)):
        replay = replay_decoding(runs[row:row + 1], [len(conversation.tokens)], [conversation.prompt_len])
        assert output["meta_info"]["spec_verify_ct"] == replay.verify_steps, f"conversation {row}"
    histogram = Counter()
    for output in outputs:
        histogram.update(output["meta_info"]["spec_accept_histogram"])
    assert histogram[2] > histogram[1] > 0       # drafts mostly accepted, some rejected


def test_stops_inside_an_accepted_path_are_cut(target, head_dir):  # noqa: F811
    """Each answer stopped at its k-th token for several k (its token a stop token, earlier
    ones held back by min_new_tokens = k, which the engine verifies until it is reached)."""
    path, _, _, held_out = target
    _, head_path, _, _ = head_dir
    cases = [(c.tokens[:c.prompt_len], c.tokens[c.prompt_len:], k) for c in held_out for k in range(3, 12)
             if len(c.tokens) - c.prompt_len > k + 1]
    params = [{**GREEDY, "stop_token_ids": [answer[k]], "min_new_tokens": k} for _, answer, k in cases]
    prompts = [prompt for prompt, _, _ in cases]
    expected = plain_greedy_outputs(path, prompts, params)
    with tiny_engine(path, max_running_requests=1, **fused_args("NAIVE_EAGLE", head_path)) as engine:
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    assert any(truncated_mid_path(o) for o in outputs) and spy.fused > 0 and spy.engine > 0


def test_an_untrained_head_keeps_greedy_output_and_frees_everything(tmp_path):
    """A 256-token target and a random head over half its vocabulary: batches, an abort,
    preemption (a small cache), sampled and penalised requests in the same batches."""
    target_path, head_path = tmp_path / "target", tmp_path / "head"
    make_tiny_directory(target_path, "qwen2", seed=1)
    save_random_eagle_head(target_path, head_path, draft_vocab=torch.arange(0, 256, 2))
    prompts = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    penalised = {**greedy, "repetition_penalty": 1.3}
    with tiny_engine(target_path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
        expected_penalised = plain.generate(input_ids=prompts[0], sampling_params=penalised)["output_ids"]
    with tiny_engine(target_path, max_total_tokens=120, **fused_args("NAIVE_EAGLE", head_path)) as engine:
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert [o["output_ids"] for o in outputs] == expected
        # (when the head's cache is as full as the target's, a batch goes to the engine: fewer drafts, same output)
        assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0 and spy.fused > 0
        stream = engine.generate(input_ids=prompts[1], sampling_params={**greedy, "max_new_tokens": 60}, stream=True)
        next(iter(stream))
        stream.close()     # aborts it
        mixed = engine.generate(input_ids=prompts[:3], sampling_params=[
            penalised, {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}, greedy])
        assert mixed[0]["output_ids"] == expected_penalised and mixed[2]["output_ids"] == expected[2]
        assert len(mixed[1]["output_ids"]) == 20
        wait_until_fused_state_is_free(engine)


# ---- sampling ----
@pytest.fixture(scope="module")
def sampling_target(tmp_path_factory):
    """test_spec_sampling's 16-token target and its exact joint distribution of four tokens."""
    target_path = tmp_path_factory.mktemp("naive-v16")
    hf_target = make_tiny_directory(target_path, "llama", vocab_size=SAMPLING_VOCAB, tokenizer="letters",
                                    weight_std=None, logit_scale=20.0)
    return target_path, exact_step_logits(hf_target.double())


@pytest.fixture(scope="module", params=["NAIVE_EAGLE", "MTP"])
def sampling_models(request, sampling_target, tmp_path_factory):
    """(target, algorithm, a random head for it, the target's step logits): an EAGLE head
    drafts over a subset of ids mapped to the target's (d2t), an MTP layer over all of them."""
    target_path, step_logits = sampling_target
    head_path = tmp_path_factory.mktemp(f"v16-{request.param}")
    if request.param == "MTP":
        save_random_mtp_head(target_path, head_path, seed=3, std=0.1)
    else:
        save_random_eagle_head(target_path, head_path, algorithm="EAGLE", seed=3,
                               draft_vocab=torch.arange(1, SAMPLING_VOCAB))
    return target_path, request.param, head_path, step_logits


class FusedVerifySpy:
    """The rules the fused steps verified sampled batches with."""

    def __init__(self, monkeypatch):
        self.rules = Counter()
        original = specserve.runner.fused_chain.verify_sampling

        def spy(trees, logits, *args, rule, **kwargs):
            self.rules[rule, args[-1] is not None] += 1     # the last positional argument: draft_probs
            return original(trees, logits, *args, rule=rule, **kwargs)
        monkeypatch.setattr(specserve.runner.fused_chain, "verify_sampling", spy)


def sample(models, config: dict, seeded: bool = False) -> list[dict]:
    target_path, algorithm, head_path, _ = models
    params = [{**config, "max_new_tokens": 5, "ignore_eos": True, **({"seed": i} if seeded else {})}
              for i in range(SAMPLES)]
    with tiny_engine(target_path, max_running_requests=1024, **fused_args(algorithm, head_path)) as engine:
        spy = FusedSpy(engine.core.drafter)
        outputs = engine.generate(input_ids=[PROMPT] * SAMPLES, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    assert spy.engine == 0 and spy.fused > 0
    return outputs


@pytest.mark.parametrize("config", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 4}], ids=str)
def test_samples_follow_the_exact_distribution(sampling_models, monkeypatch, config):
    spy = FusedVerifySpy(monkeypatch)
    outputs = sample(sampling_models, config)
    assert set(spy.rules) == {("rejection", True)}      # every step: residual rejection with q
    histogram = Counter()
    for output in outputs:
        histogram.update(output["meta_info"]["spec_accept_histogram"])
    assert histogram[2] > 0.1 * sum(histogram.values()), histogram      # drafts get accepted
    p = chi_square_p(outputs, exact_joint(sampling_models[3], **config))
    assert p > 1e-4, f"{config}: chi-square p = {p:.3g}"


def test_chi_square_catches_an_accept_rule_that_ignores_q(sampling_models, monkeypatch):
    def ignores_q(u, residual_x, residual_mass, draft_q_x):
        return u * residual_mass < residual_x
    monkeypatch.setattr(verify, "_accept", ignores_q)
    outputs = sample(sampling_models, {"temperature": 1.0})
    p = chi_square_p(outputs, exact_joint(sampling_models[3], temperature=1.0))
    assert p < 1e-6, f"p = {p:.3g}: a verifier that ignores q went unnoticed"


def test_seeded_requests_get_the_tokens_of_plain_decoding(sampling_models, monkeypatch):
    """A seed asks for plain decoding's tokens: argmax drafts and the coupled rule."""
    target_path, algorithm, head_path, _ = sampling_models
    prompts = [PROMPT[i:] for i in range(8)]
    params = [{"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": 100 + i} for i in range(8)]
    with tiny_engine(target_path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=params)]
    spy = FusedVerifySpy(monkeypatch)
    with tiny_engine(target_path, **fused_args(algorithm, head_path)) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        wait_until_fused_state_is_free(engine)
    assert [o["output_ids"] for o in outputs] == expected
    assert set(spy.rules) == {("coupled", False)}


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
