"""Training on fixed text (a chat's own replies) and the trainer's held-out checks, on a tiny
random target: the head learns the target's distribution over the text (its labels are the
target's choices, not the text), fixed text alone trains a head that drafts the target's
own answers, and the trainer keeps the head of its best held-out score."""
from __future__ import annotations

import pytest
import torch

from specserve.training.draft_vocab import most_frequent_tokens
from specserve.training.eagle_batches import BatchBuilder
from specserve.training.eagle_data import Conversation, generate_conversations
from specserve.training.eagle_eval import accept_length
from specserve.training.eagle_trainer import EagleTrainer, TrainSettings, build_head, target_lm_head
from specserve.training.target_features import TargetFeatureExtractor
from tests.spec_fixtures import make_tiny_directory, tiny_engine

VOCAB = 16


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """(target model, fixed-text conversations of random tokens, the target's greedy answers
    to other prompts held out)."""
    path = tmp_path_factory.mktemp("tiny-fixed-text-target")
    make_tiny_directory(path, vocab_size=VOCAB, tokenizer="letter", weight_std=None, logit_scale=100.0)
    engine = tiny_engine(path)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (8,), generator=generator).tolist() for _ in range(8)]
    held_out = generate_conversations(engine, prompts, max_new_tokens=32, temperature=0.0)
    model = engine.core.runner.model
    engine.shutdown()
    texts = []
    for _ in range(40):
        tokens = torch.randint(3, VOCAB, (40,), generator=generator).tolist()
        texts.append(Conversation(tokens, 4, reply_spans=[[4, 18], [22, 40]]))   # two replies, a user turn between
    return model, texts, held_out


def make_builder(model, conversations):
    torch.manual_seed(0)
    draft_vocab = most_frequent_tokens((c.answer_tokens() for c in conversations), VOCAB, VOCAB)
    head = build_head(model, "EAGLE3", draft_vocab, max_positions=64)
    extractor = TargetFeatureExtractor(model, head.config.aux_layers, 512, 64, 64)
    return head, BatchBuilder(extractor, target_lm_head(model)[head.draft_vocab()], True)


def test_fixed_text_teaches_the_targets_distribution_at_the_replies(tiny_target):
    model, texts, _ = tiny_target
    head, builder = make_builder(model, texts)
    batch = builder(texts[:2])
    padded = batch.conversations
    learned = torch.zeros(40, dtype=torch.bool)
    learned[5:18] = learned[23:40] = True     # each reply but its first token (prefill makes it)
    assert torch.equal(padded.learned, learned.expand(2, 40))
    logits = builder.extractor([c.tokens for c in texts[:2]]).final @ builder.draft_lm_head.t()   # (80, vocab)
    _, targets = batch.draft_targets(3)
    differs = 0
    for step, target in enumerate(targets):
        flat = padded.predicts_answer(step).flatten().nonzero().squeeze(1)   # b * 40 + t predicts t + 2 + step
        assert torch.equal(padded.learned.flatten()[flat + 2 + step], torch.ones(len(flat), dtype=torch.bool))
        at = flat + 1 + step   # the target's logits there predict token t + 2 + step
        torch.testing.assert_close(batch.teacher_probs[target.teacher_rows], logits[at].softmax(-1))
        assert torch.equal(head.to_target_ids(target.labels), logits[at].argmax(-1))
        differs += int((head.to_target_ids(target.labels) != padded.tokens.flatten()[flat + 2 + step]).sum())
    assert differs > 0   # random text is not what the target would say: the labels are the target's


def held_out_score(head, builder, held_out) -> float:
    eval_builder = BatchBuilder(builder.extractor, None, True)
    return accept_length(head, [eval_builder(held_out).conversations], draft_steps=3).accept_length


def test_fixed_text_alone_trains_a_head_that_drafts_the_targets_answers(tiny_target):
    model, texts, held_out = tiny_target
    head, builder = make_builder(model, texts)
    untrained = held_out_score(head, builder, held_out)
    trainer = EagleTrainer(head, builder, texts, TrainSettings(ttt_steps=3, epochs=10, batch_tokens=320, lr=3e-3))
    trainer.train()
    trained = held_out_score(head, builder, held_out)
    assert trained > untrained + 0.5, (untrained, trained)


def test_the_best_held_out_head_is_kept(tiny_target):
    model, texts, _ = tiny_target
    head, builder = make_builder(model, texts)
    scores, states = iter([1.0, 3.0, 2.0, 1.5, 0.5, 2.5] + [0.0] * 100), []

    def evaluate(scored):
        assert not scored.training
        states.append({name: value.clone() for name, value in scored.state_dict().items()})
        return next(scores)
    settings = TrainSettings(ttt_steps=2, epochs=1, batch_tokens=160, lr=3e-3, eval_every=2)
    trainer = EagleTrainer(head, builder, texts[:24], settings, evaluate=evaluate)
    trainer.train()
    assert trainer.step == 6 and [step for step, _ in trainer.scores] == [2, 4, 6]
    assert trainer.best_score == (4, 3.0) and not head.training
    for name, value in head.state_dict().items():
        torch.testing.assert_close(value, states[1][name], msg=name)
    assert not torch.equal(states[1]["fc.weight"], states[2]["fc.weight"])   # it did train after step 4
