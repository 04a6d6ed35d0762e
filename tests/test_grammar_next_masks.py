"""The masks of a plain step of constrained requests (grammar/next_masks.py): filled one by one
for a few requests and on MaskFiller's threads for many, the same bits either way and on any
number of threads, every word of a row written; a grammar that has ended allows every token, a
request without one too; the masked argmax picks the best allowed token."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.grammar import matcher as matcher_module
from specserve.grammar.mask_fill import MIN_ROWS_PER_THREAD, MaskFiller
from specserve.grammar.matcher import bitmask_words
from specserve.grammar.next_masks import masked_argmax, next_token_bitmask
from specserve.request.grammar_spec import GrammarSpec
from tests.test_spec_greedy import plain, smol  # noqa: F401 (fixtures: SmolLM2 engines)

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def grammars_in_several_states(engine, copies: int = 2) -> list:
    """Matchers after 0, 1, 2, ... tokens of one JSON answer, one that has ended, `copies`
    times (distinct matchers: a matcher is filled by one thread at a time), and no grammar."""
    answer = engine.tokenizer('{"a": 12}').input_ids + [engine.tokenizer.eos_token_id]
    grammars = []
    for _ in range(copies):
        for depth in range(len(answer) + 1):
            grammar = engine.grammars.matcher(GrammarSpec("json_schema", SCHEMA))
            for token in answer[:depth]:
                assert grammar.accept(token)
            grammars.append(grammar)
    assert grammars[-1].terminated and not grammars[0].terminated
    return grammars + [None]


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


@pytest.mark.parametrize("threads", [1, 3])
def test_fills_on_any_number_of_threads_agree(plain, monkeypatch, threads):
    grammars = grammars_in_several_states(plain, copies=6)
    vocab = plain.core.runner.config.vocab_size
    serial = torch.zeros((len(grammars), bitmask_words(vocab)), dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        if grammar is not None and not grammar.terminated:
            grammar._matcher.fill_next_token_bitmask(serial, row)
    monkeypatch.setattr(matcher_module, "_batch_filler", MaskFiller(threads))
    threaded = torch.zeros_like(serial)
    matcher_module.fill_next_masks(grammars, threaded)
    live = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    assert len(live) >= 2 * threads * MIN_ROWS_PER_THREAD        # every thread had rows to fill
    assert torch.equal(threaded[live], serial[live])


def test_every_word_of_a_filled_row_is_written(plain):
    """next_token_bitmask leaves a constrained row as allocated before its fill: what was in
    the memory must not show through."""
    grammars = grammars_in_several_states(plain)
    vocab = plain.core.runner.config.vocab_size
    rows = {}
    for garbage in (0, 0x5A5A5A5A, -1):
        out = torch.full((len(grammars), bitmask_words(vocab)), garbage, dtype=torch.int32)
        matcher_module.start_next_masks(grammars, out).wait()
        rows[garbage] = out[:-1]   # the last has no grammar: left as it was
    assert torch.equal(rows[0], rows[0x5A5A5A5A]) and torch.equal(rows[0], rows[-1])

