"""The masks of a plain step of constrained requests (grammar/next_masks.py): filled one by one
for a few requests and by xgrammar's threads for many, the same bits either way; a grammar that
has ended allows every token, a request without one too; the masked argmax picks the best
allowed token."""
from __future__ import annotations

import json

import torch

from specserve.grammar import matcher as matcher_module
from specserve.grammar.next_masks import masked_argmax, next_token_bitmask
from specserve.request.grammar_spec import GrammarSpec
from tests.test_spec_greedy import plain, smol  # noqa: F401 (fixtures: SmolLM2 engines)

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def grammars_in_several_states(engine) -> list:
    """Matchers after 0, 1, 2, ... tokens of one JSON answer, one that has ended, and no grammar."""
    answer = engine.tokenizer('{"a": 12}').input_ids + [engine.tokenizer.eos_token_id]
    grammars = []
    for depth in range(len(answer) + 1):
        grammar = engine.grammars.matcher(GrammarSpec("json_schema", SCHEMA))
        for token in answer[:depth]:
            assert grammar.accept(token)
        grammars.append(grammar)
    assert grammars[-1].terminated and not grammars[0].terminated
    return grammars * 2 + [None]


def test_threaded_and_serial_fills_agree(plain, monkeypatch):
    grammars = grammars_in_several_states(plain)
    vocab = plain.core.runner.config.vocab_size
    assert sum(g is not None and not g.terminated for g in grammars) >= matcher_module.BATCH_FILL_MIN
    threaded = next_token_bitmask(grammars, vocab)
    monkeypatch.setattr(matcher_module, "BATCH_FILL_MIN", 10**6)
    serial = next_token_bitmask(grammars, vocab)
    assert torch.equal(threaded, serial)
    assert (serial[-1] == -1).all()                               # no grammar: everything
    ended = [i for i, g in enumerate(grammars) if g is not None and g.terminated]
    assert ended and all((serial[i] == -1).all() for i in ended)  # ended: everything
    assert (serial[0] != -1).any()                                # a live one restricts


def test_masked_argmax_picks_the_best_allowed_token(plain):
    grammar = plain.grammars.matcher(GrammarSpec("json_schema", SCHEMA))
    vocab = plain.core.runner.config.vocab_size
    brace = plain.tokenizer("{").input_ids[0]
    logits = torch.zeros((2, vocab))
    logits[:, 5] = 10.0                 # the best token overall, which JSON does not start with
    logits[:, brace] = 1.0
    assert masked_argmax(logits, [grammar, None]).tolist() == [brace, 5]
