"""EAGLE / EAGLE3 through the Engine, with heads our trainer made and saved in the SGLang /
SpecForge layout (the fixtures here train them; the greedy identity and the verify steps the
trainer's replay predicts are checked in test_eagle_fused_chain.py, the chains' default path,
and test_eagle_drafter_tree.py for trees). Greedy output of an untrained head equals plain
decoding and the head's KV pool and the target states it waits for are freed however
requests end; sampled drafts are drawn from the q handed to verification; the flags are
checked.

The target is a random 16-token model with peaky logits whose greedy answers settle into
cycles a head learns in seconds (as in tests/test_train_eagle.py).
"""
from __future__ import annotations

from collections import Counter

import pytest
import scipy.stats
import torch

from specserve.errors import ArgumentError, NotSupportedError
from specserve.speculative.heads.eagle_checkpoint import save_head
from specserve.speculative.model_drafters.eagle import EagleDrafter
from specserve.training.draft_vocab import most_frequent_tokens
from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_data import generate_conversations
from specserve.training.eagle_trainer import EagleTrainer, TrainSettings, build_head, target_lm_head
from specserve.training.target_features import TargetFeatureExtractor
from tests.spec_fixtures import (assert_draft_pool_is_free, cached_draft_rows, make_tiny_directory, tiny_engine,
                                 wait_until_all_kv_is_free)

VOCAB = 16
NUM_STEPS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(path, target model, train conversations, held-out conversations)."""
    path = tmp_path_factory.mktemp("eagle-target")
    make_tiny_directory(path, vocab_size=VOCAB, tokenizer="letter", weight_std=None, logit_scale=100.0)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(torch.randint(4, 12, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(48)]
    with tiny_engine(path) as engine:
        conversations = generate_conversations(engine, prompts, max_new_tokens=32, temperature=0.0)
        model = engine.core.runner.model
    return path, model, conversations[8:], conversations[:8]


@pytest.fixture(scope="module", params=["EAGLE3", "EAGLE"])
def head_dir(request, target, tmp_path_factory) -> tuple[str, str, object]:
    """(algorithm, saved head directory, the head): trained a few epochs on the target's answers."""
    _, model, train, _ = target
    torch.manual_seed(0)
    draft_vocab = most_frequent_tokens((c.tokens[c.prompt_len:] for c in train), VOCAB, VOCAB // 2)
    head = build_head(model, request.param, draft_vocab, max_positions=64)
    extractor = TargetFeatureExtractor(model, head.config.aux_layers, 512, 64, 64)
    builder = BatchBuilder(extractor, target_lm_head(model)[head.draft_vocab()], bool(head.config.aux_layers))
    EagleTrainer(head, builder, train, TrainSettings(ttt_steps=NUM_STEPS, epochs=3, batch_tokens=256, lr=3e-3)).train()
    path = tmp_path_factory.mktemp(f"head-{request.param}")
    save_head(head, str(path))
    return request.param, str(path), head, extractor


def eagle_args(algorithm: str, head_path: str, adaptive: bool = False, **extra) -> dict:
    """Every step drafts, or with the adaptive policy (the engine's default)."""
    return {"speculative_algorithm": algorithm, "speculative_draft_model_path": head_path,
            "speculative_num_steps": NUM_STEPS, "speculative_disable_adaptive": not adaptive, **extra}


def wait_until_head_kv_is_free(engine) -> None:
    drafter = engine.core.drafter
    pool = drafter.runner.pool
    wait_until_all_kv_is_free(engine)
    assert not drafter.kv.sequences and not drafter.states._states and drafter.states.held_rows == 0
    assert_draft_pool_is_free(pool, cached_draft_rows(engine))


def write_random_eagle3_head(directory) -> tuple[str, str]:
    """(a 256-token random llama target, a random EAGLE-3 head over its even tokens), written under directory."""
    from specserve.model.loader import load_checkpoint
    from specserve.runner.model_runner import build_model
    target_path, head_path = directory / "target", directory / "head"
    make_tiny_directory(target_path, "llama", seed=1)
    checkpoint = load_checkpoint(str(target_path), dtype=torch.float32)
    model = build_model(checkpoint.config, checkpoint.state_dict, torch.device("cpu"), torch.float32, 512)
    torch.manual_seed(0)
    save_head(build_head(model, "EAGLE3", torch.arange(0, 256, 2), max_positions=512), str(head_path))
    return str(target_path), str(head_path)


def test_an_untrained_head_keeps_greedy_output_and_frees_everything(tmp_path):
    """A 256-token target, a random head over half its vocabulary; batches, a stop token
    inside a chain, an abort and preemption (a small cache)."""
    target_path, head_path = write_random_eagle3_head(tmp_path)
    prompts = [[5, 6, 7, 8, 9] * 6 + [10, 11], [20, 21, 22, 23] * 5, list(range(30, 72)), [100, 101] * 9]
    greedy = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with tiny_engine(target_path) as plain:
        expected = [o["output_ids"] for o in plain.generate(input_ids=prompts, sampling_params=greedy)]
    with tiny_engine(target_path, **eagle_args("EAGLE3", head_path), max_total_tokens=120) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=greedy)
        assert [o["output_ids"] for o in outputs] == expected
        assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
        stop = engine.generate(input_ids=prompts[0], sampling_params={**greedy, "stop_token_ids": [expected[0][7]]})
        assert stop["output_ids"] == expected[0][:expected[0].index(expected[0][7]) + 1]
        stream = engine.generate(input_ids=prompts[1], sampling_params={**greedy, "max_new_tokens": 60}, stream=True)
        next(iter(stream))
        stream.close()     # aborts it
        sampled = engine.generate(input_ids=prompts[:2], sampling_params={"temperature": 1.0, "max_new_tokens": 20,
                                                                          "ignore_eos": True})
        assert [len(o["output_ids"]) for o in sampled] == [20, 20]
        wait_until_head_kv_is_free(engine)


def test_sampled_drafts_are_drawn_from_the_q_they_hand_over(target, head_dir, monkeypatch):
    """Many sampled chains (EagleDrafter's: every request's first drafts, which the fused
    drafter hands to its first fused step): the first drafts' counts follow the sum of
    their q (chi-square; each request's q differs with its sampled first token), and q is a
    distribution over the head's draft vocabulary."""
    path, _, _, held_out = target
    algorithm, head_path, _, _ = head_dir
    proposals = []
    propose = EagleDrafter.propose

    def spy(drafter, reqs, max_nodes):
        proposal, num_nodes = propose(drafter, reqs, max_nodes)
        drafted = [i for i, n in enumerate(num_nodes) if n > 1]
        if proposal.draft_probs is not None and drafted:
            proposals.append((proposal.tokens[drafted, 1].tolist(), proposal.draft_probs[drafted, 0].clone()))
        return proposal, num_nodes
    monkeypatch.setattr(EagleDrafter, "propose", spy)
    with tiny_engine(path, **eagle_args(algorithm, head_path)) as engine:
        prompt = held_out[0].tokens[:held_out[0].prompt_len]
        # a high temperature: q spreads over several tokens; one verify step each, of a first draft or more
        engine.generate(input_ids=[prompt] * 1500, sampling_params={"temperature": 3.0, "max_new_tokens": 3})
    first_drafts = [t for tokens, _ in proposals for t in tokens]
    q = torch.cat([probs for _, probs in proposals])
    draft_vocab = torch.tensor(sorted(set(torch.nonzero(q.sum(0)).flatten().tolist())))
    assert torch.allclose(q.sum(-1), torch.ones(len(q)), atol=1e-5) and len(draft_vocab) <= VOCAB // 2
    assert len(first_drafts) == len(q) >= 1000
    counts = Counter(first_drafts)
    expected = q.sum(0)
    cells = [t for t in range(VOCAB) if expected[t] >= 5]
    observed = [counts[t] for t in cells] + [len(q) - sum(counts[t] for t in cells)]
    wanted = [expected[t].item() for t in cells] + [len(q) - sum(expected[t].item() for t in cells)]
    assert len(cells) >= 3
    assert scipy.stats.chisquare(observed, wanted).pvalue > 1e-4


def test_flags_are_checked(target, head_dir, tmp_path):
    path = target[0]
    algorithm, head_path, _, _ = head_dir
    other = "EAGLE" if algorithm == "EAGLE3" else "EAGLE3"
    with pytest.raises(ArgumentError, match="speculative_draft_model_path.*head"):
        tiny_engine(path, **eagle_args(other, head_path))
    with pytest.raises(ArgumentError, match="config.json"):
        tiny_engine(path, **eagle_args(algorithm, str(tmp_path)))
    with pytest.raises(ArgumentError, match="speculative_num_draft_tokens"):
        tiny_engine(path, **eagle_args(algorithm, head_path, speculative_eagle_topk=2, speculative_num_draft_tokens=12))
    with pytest.raises(ArgumentError, match="speculative_eagle_topk"):
        tiny_engine(path, **eagle_args(algorithm, head_path, speculative_eagle_topk=9))   # > the draft vocabulary
    with pytest.raises(NotSupportedError, match="speculative_eagle_topk"):
        tiny_engine(path, speculative_algorithm="STANDALONE", speculative_draft_model_path=str(path),
                    speculative_eagle_topk=2)
