"""A request the KV cache cannot hold to its max_new_tokens ends where the cache ends, and
says so: its finish reason (still "length", as clients expect) carries a message naming
max_new_tokens and --max-total-tokens, and the engine logs it. A cap by the model's context
stays silent, as in SGLang and vLLM."""
from __future__ import annotations

import logging

import pytest

from specserve.engine.front import RequestLimits, capped_max_new_tokens
from tests.spec_fixtures import make_tiny_directory, tiny_engine

KV_TOKENS = 64


def test_the_cache_cap_has_a_message_and_the_context_cap_none():
    limits = RequestLimits(vocab_size=100, context_length=512, kv_slots=256)
    assert capped_max_new_tokens(195, 50, limits) == (50, None)
    assert capped_max_new_tokens(195, 62, limits) == (62, None)   # the last token needs no slot
    tokens, message = capped_max_new_tokens(195, 200, limits)
    assert tokens == 62 and message.startswith("max_new_tokens 200 cut to 62: the KV cache holds 256 tokens")
    assert "--max-total-tokens" in message
    roomy = RequestLimits(vocab_size=100, context_length=256, kv_slots=4096)
    assert capped_max_new_tokens(200, 100, roomy) == (56, None)


@pytest.fixture(scope="module")
def small_cache_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-kv-cap")
    make_tiny_directory(path)
    engine = tiny_engine(path, max_total_tokens=KV_TOKENS)
    yield engine
    engine.shutdown()


def test_a_request_cut_by_the_cache_says_so(small_cache_engine, caplog):
    prompt = list(range(3, 43))   # 40 tokens: the cache leaves room for 25 more
    with caplog.at_level(logging.WARNING, logger="specserve"):
        out = small_cache_engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 200,
                                                                             "ignore_eos": True})
    meta = out["meta_info"]
    assert meta["completion_tokens"] == KV_TOKENS + 1 - len(prompt)
    reason = meta["finish_reason"]
    assert reason["type"] == "length" and reason["length"] == meta["completion_tokens"]
    assert reason["message"].startswith(f"max_new_tokens 200 cut to {KV_TOKENS + 1 - len(prompt)}")
    assert any(reason["message"] in r.getMessage() for r in caplog.records)


def test_a_request_that_fits_ends_as_before(small_cache_engine):
    out = small_cache_engine.generate(input_ids=list(range(3, 43)), sampling_params={"max_new_tokens": 10,
                                                                                     "ignore_eos": True})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
