"""A plain greedy step's unmasked argmax kept to each request's grammar on the host
(grammar/next_masks.py): the result is the masked argmax (each live grammar's mask filled and
applied to the logits, then the argmax) for matchers in every state of an answer, on random
logits and on ties; an allowed token costs no mask and no read of the logits; a request
without a grammar, or whose grammar has ended, keeps its token."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.grammar.apply import apply_grammar_bitmask
from specserve.grammar.matcher import bitmask_words
from specserve.grammar.next_masks import keep_plain_to_grammar
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
    return grammars + [None]


def masked_argmax(grammars: list, logits: torch.Tensor) -> list[int]:
    """The reference: every live grammar's mask filled and applied, then the argmax."""
    mask = torch.full((len(grammars), bitmask_words(logits.shape[-1])), -1, dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        if grammar is not None and not grammar.terminated:
            grammar._matcher.fill_next_token_bitmask(mask, row)
    return apply_grammar_bitmask(logits, mask).argmax(-1).tolist()


def kept(grammars: list, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """keep_plain_to_grammar's tokens and changed rows; the matchers left as they were (the
    commit's accepts, which would confirm the tokens taken ahead, do not come here)."""
    tokens = logits.argmax(-1).tolist()
    changed = keep_plain_to_grammar(grammars, tokens, lambda rows: logits[rows])
    for grammar in grammars:
        if grammar is not None:
            grammar._drop_ahead()
    return tokens, changed


@pytest.mark.parametrize("seed", range(4))
def test_kept_tokens_are_the_masked_argmax(plain, seed):
    grammars = grammars_in_several_states(plain)
    vocab = plain.core.runner.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn((len(grammars), vocab), generator=generator)
    unmasked = logits.argmax(-1).tolist()
    tokens, changed = kept(grammars, logits)
    assert tokens == masked_argmax(grammars, logits)
    assert changed and changed == [row for row in range(len(grammars)) if tokens[row] != unmasked[row]]
    assert tokens[-1] == unmasked[-1] and tokens[-2] == unmasked[-2]   # no grammar; ended: unchanged


def test_ties_pick_what_the_masked_argmax_picks(plain):
    """torch's argmax picks the first of tied maxima, masked or not: an allowed first one is
    kept; a forbidden first one gives way to the first allowed one among the tied."""
    vocab = plain.core.runner.config.vocab_size
    grammars = [plain.grammars.matcher(GrammarSpec("json_schema", SCHEMA)) for _ in range(2)]
    brace = plain.tokenizer("{").input_ids[0]
    allowed = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
    grammars[0]._matcher.fill_next_token_bitmask(allowed, 0)
    forbidden = [t for t in range(brace) if not (int(allowed[0, t >> 5]) >> (t & 31)) & 1]
    assert forbidden, "a token before '{' that JSON does not start with"
    logits = torch.zeros((2, vocab))
    logits[0, [brace, vocab - 1]] = 5.0         # allowed first, a forbidden one tied after it
    logits[1, [forbidden[0], brace]] = 5.0      # forbidden first, the allowed one tied after it
    tokens, changed = kept(grammars, logits)
    assert tokens == masked_argmax(grammars, logits) == [brace, brace]
    assert changed == [1]


def test_an_allowed_token_fills_no_mask_and_reads_no_logits(plain, monkeypatch):
    import xgrammar
    fills = []
    fill = xgrammar.GrammarMatcher.fill_next_token_bitmask
    monkeypatch.setattr(xgrammar.GrammarMatcher, "fill_next_token_bitmask",
                        lambda self, *args, **kw: fills.append(1) or fill(self, *args, **kw))
    grammars = grammars_in_several_states(plain)
    answer = plain.tokenizer('{"a": 12}').input_ids + [plain.tokenizer.eos_token_id]
    tokens = answer + [5, 5]   # each live matcher's next answer token; the ended one, the free one: any

    def no_logits(rows):
        raise AssertionError("the logits were read where every token is allowed")
    assert keep_plain_to_grammar(grammars, list(tokens), no_logits) == []
    assert not fills
    for grammar, token in zip(grammars[:-2], answer):   # taken ahead: the commit's accept confirms it
        assert grammar.accept(token)


def test_a_token_the_grammar_forces_replaces_a_stray_without_reading_the_logits(plain):
    """Where the grammar allows one token only (a fixed key, a closing brace, the stop token
    after the answer), a plain step's stray takes it from the mask: no read of the device."""
    from specserve.grammar.greedy_paths import _only_token
    vocab = plain.core.runner.config.vocab_size
    forced = []
    for grammar in grammars_in_several_states(plain)[:-2]:   # the live ones
        mask = torch.zeros((1, bitmask_words(vocab)), dtype=torch.int32)
        grammar._matcher.fill_next_token_bitmask(mask, 0)
        token = _only_token(mask)
        if token is not None:
            forced.append((grammar, token))
    assert forced, "a state of the answer where the schema allows one token"

    def no_logits(rows):
        raise AssertionError("the logits were read for a token the grammar forces")
    grammars = [grammar for grammar, _ in forced]
    strays = [(token + 1) % vocab for _, token in forced]
    assert keep_plain_to_grammar(grammars, strays, no_logits) == list(range(len(forced)))
    assert strays == [token for _, token in forced]


def test_a_path_ends_at_its_stop_token_and_only_a_path_without_one_is_confirmed_whole(plain):
    """check_path asks whether the grammar ended only after a stop token; a path through the stop
    token ends there (the tokens after it not taken, nothing masked), and the commit confirms a
    path taken ahead at once only where no token of it can end the grammar."""
    eos = plain.tokenizer.eos_token_id
    answer = plain.tokenizer('{"a": 12}').input_ids
    grammar = plain.grammars.matcher(GrammarSpec("json_schema", SCHEMA))
    check = grammar.check_path(answer + [eos, 5], keep=True)
    assert (check.allowed, check.ended, check.mask) == (len(answer) + 1, True, None)
    assert not grammar.confirm_ahead(answer + [eos])          # its stop token: one by one
    assert all(grammar.accept(token) for token in answer + [eos]) and grammar.terminated

    grammar = plain.grammars.matcher(GrammarSpec("json_schema", SCHEMA))
    check = grammar.check_path(answer, keep=True)
    assert (check.allowed, check.ended, check.mask) == (len(answer), False, None)
    assert not grammar.confirm_ahead(answer[:1] + [5])         # not what was taken ahead
    assert grammar.confirm_ahead(answer) and not grammar.terminated
    assert grammar.accept(eos) and grammar.terminated


def test_take_one_takes_an_allowed_token_ahead_and_leaves_a_forbidden_one_untaken(plain):
    """The plain step's one matcher call a row: an allowed token is taken ahead (the commit
    confirms it without a second accept); a forbidden one, or any token after the grammar's
    end, returns False with the matcher as it was."""
    grammars = grammars_in_several_states(plain)
    answer = plain.tokenizer('{"a": 12}').input_ids + [plain.tokenizer.eos_token_id]
    first, ended = grammars[0], grammars[-2]
    stray = plain.tokenizer("x").input_ids[0]
    assert not first.take_one(stray)                  # forbidden at the start of a JSON object
    assert first.check_path([stray]).mask is not None   # ... and still forbidden: nothing moved
    assert first.take_one(answer[0]) and first.confirm_ahead([answer[0]])
    assert first.accept(answer[1])                    # the matcher is one token on, as if accepted
    assert not ended.take_one(answer[0]) and ended.terminated
