"""IncrementalDetokenizer's direct Rust decode returns what transformers' decode returns,
token by token (random ids, special tokens included, both skip settings), and is used only
where transformers' wrapper would change nothing."""
from __future__ import annotations

import random

import pytest
import transformers

from spec_fixtures import save_bpe_tokenizer
from specserve.request.detokenizer import IncrementalDetokenizer, _direct_decode


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("bpe"))
    save_bpe_tokenizer(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_direct_decode_streams_the_same_text(tokenizer, skip_special_tokens):
    assert _direct_decode(tokenizer, skip_special_tokens) is not None
    rng = random.Random(0)
    for _ in range(20):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(6)]
        ids = [rng.randrange(len(tokenizer)) for _ in range(60)]
        direct = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        wrapped = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
        wrapped._decode_ids = None   # transformers' decode, as before
        pieces_direct, pieces_wrapped = [], []
        for token in ids:
            direct.add(token)
            wrapped.add(token)
            pieces_direct.append(direct.text)
            pieces_wrapped.append(wrapped.text)
        direct.flush()
        wrapped.flush()
        assert pieces_direct == pieces_wrapped
        # a character cut at the end (a lone lead byte) is dropped, not emitted as "\ufffd"
        full_text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert direct.text == wrapped.text == full_text.rstrip("\ufffd")


def test_tokenizers_that_clean_up_spaces_keep_transformers_decode(tokenizer):
    cleaning = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer,
                                                    clean_up_tokenization_spaces=True)
    assert _direct_decode(cleaning, True) is None
    assert IncrementalDetokenizer(cleaning, [5])._decode_ids is None


def groups_of(ids: list[int], rng: random.Random) -> list[list[int]]:
    """`ids` in consecutive groups of 1-12 tokens, as drafting steps commit them."""
    groups, at = [], 0
    while at < len(ids):
        size = rng.randrange(1, 13)
        groups.append(ids[at:at + size])
        at += size
    return groups


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_tokens_added_together_give_the_text_of_tokens_added_one_by_one(tokenizer, skip_special_tokens):
    """After every group (a step's committed tokens) the text is what one-by-one adds leave,
    with random ids (lone bytes of multi-byte characters, special tokens) and real text."""
    rng = random.Random(1)
    streams = [[rng.randrange(len(tokenizer)) for _ in range(80)] for _ in range(20)]
    streams.append(tokenizer("héllo wörld, 日本語のテキスト 🙂🙂 tiny tokenizer").input_ids)
    batched_decodes = 0
    for ids in streams:
        together = IncrementalDetokenizer(tokenizer, ids[:3], skip_special_tokens)
        one_by_one = IncrementalDetokenizer(tokenizer, ids[:3], skip_special_tokens)
        for group in groups_of(ids, rng):
            before = len(together._ids)
            together.add_many(group)
            batched_decodes += len(group) > 1 and together._read_offset > before
            for token in group:
                one_by_one.add(token)
            assert together.text == one_by_one.text
        together.flush()
        one_by_one.flush()
        assert together.text == one_by_one.text
    assert batched_decodes > 50   # most groups took the one decode pair


def test_tokens_added_together_stop_at_the_first_stop_string(tokenizer):
    ids = tokenizer("hello world, a tiny tokenizer").input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop_strings=("world",))
    assert detokenizer.add_many(ids) == "world"
    assert detokenizer.text == "hello " and detokenizer.stopped


@pytest.mark.parametrize("cut_bytes", [1, 2, 3])
def test_a_character_cut_at_finish_leaves_no_replacement_character(tokenizer, cut_bytes):
    """max_new_tokens stops inside a 4-byte emoji (byte-level tokens, one byte each here): the
    final text is the complete characters before it, without "\ufffd"."""
    whole = tokenizer("ok 🙂").input_ids
    emoji_start = len(tokenizer("ok ").input_ids)
    assert len(whole) - emoji_start == 4   # one token per byte of the emoji
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    detokenizer.add_many(whole[:emoji_start + cut_bytes])
    detokenizer.flush()
    assert detokenizer.text == "ok "
    complete = IncrementalDetokenizer(tokenizer, [])
    complete.add_many(whole)
    complete.flush()
    assert complete.text == "ok 🙂"
