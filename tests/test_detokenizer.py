"""IncrementalDetokenizer's direct Rust decode returns what transformers' decode returns,
token by token (random ids, special tokens included, both skip settings), and is used only
where transformers' wrapper would change nothing."""
from __future__ import annotations

import random

import pytest
import transformers

from spec_fixtures import save_bpe_tokenizer
from specserve.engine.detokenizer import IncrementalDetokenizer, _direct_decode


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
        assert direct.text == wrapped.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_tokenizers_that_clean_up_spaces_keep_transformers_decode(tokenizer):
    cleaning = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer,
                                                    clean_up_tokenization_spaces=True)
    assert _direct_decode(cleaning, True) is None
    assert IncrementalDetokenizer(cleaning, [5])._decode_ids is None
