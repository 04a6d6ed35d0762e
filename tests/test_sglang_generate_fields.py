"""SGLang's /generate fields: the body SGLang's `bench_serving --backend sglang` sends works,
the fields we lack are ignored (a warning, once, when one asks for something), unknown
fields are still a 400 that names them."""
from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from specserve.server import sglang_fields
from specserve.server.http import create_app

PROMPT = "def add(a, b):"
SAMPLING = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def sglang_bench_body(prompt, stream: bool) -> dict:
    """What sglang 0.5.17's bench_serving (`async_request_sglang_generate`) posts with its
    default flags: every field below is sent with every request."""
    return {("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
            "stream": stream, "lora_path": None, "return_logprob": False,
            "return_routed_experts": False, "logprob_start_len": -1}


@pytest.fixture(scope="module")
def http(engine_factory):
    engine = engine_factory(max_total_tokens=2048)
    with TestClient(create_app(engine, served_model_name="smollm2")) as client:
        client.engine = engine
        yield client


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(sglang_fields, "_warned", set())


def generate(http, body: dict) -> dict:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_sglang_bench_body_gives_the_plain_output(http, fresh_warnings, caplog):
    plain = generate(http, {"text": PROMPT, "sampling_params": SAMPLING})
    with caplog.at_level(logging.WARNING, logger="specserve"):
        from_bench = generate(http, sglang_bench_body(PROMPT, stream=False))
    assert from_bench["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 8
    assert not [r for r in caplog.records if "does not implement" in r.message]   # defaults pass silently
    ids = http.engine.tokenizer(PROMPT).input_ids
    assert generate(http, sglang_bench_body(ids, stream=False))["output_ids"] == plain["output_ids"]


def test_sglang_bench_body_streams(http):
    with http.stream("POST", "/generate", json=sglang_bench_body(PROMPT, stream=True)) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["completion_tokens"] == 8     # what the bench client counts
    assert last["text"] == generate(http, {"text": PROMPT, "sampling_params": SAMPLING})["text"]


def test_a_field_we_lack_is_ignored_with_one_warning(http, fresh_warnings, caplog):
    plain = generate(http, {"text": PROMPT, "sampling_params": SAMPLING})
    asking = {"text": PROMPT, "sampling_params": SAMPLING, "lora_path": "my-adapter", "return_hidden_states": True,
              "session_id": "s1", "priority": 3, "return_logprob": True, "logprob_start_len": 0}
    with caplog.at_level(logging.WARNING, logger="specserve"):
        first = generate(http, asking)
        generate(http, asking)
    assert first["output_ids"] == plain["output_ids"]
    assert "output_token_logprobs" in first["meta_info"]      # what we implement still works beside them
    warned = [r.getMessage() for r in caplog.records if "does not implement" in r.getMessage()]
    assert sorted(m.split("=")[0].removeprefix("/generate: ") for m in warned) == [
        "logprob_start_len", "lora_path", "priority", "return_hidden_states", "session_id"]   # once each


def test_null_means_sglang_default(http):
    body = {"text": PROMPT, "sampling_params": SAMPLING, "return_logprob": None, "top_logprobs_num": None,
            "logprob_start_len": None}
    out = generate(http, body)
    assert len(out["output_ids"]) == 8 and "output_token_logprobs" not in out["meta_info"]


@pytest.mark.parametrize("extra, message", [
    ({"lora_pat": None}, "unknown field 'lora_pat'; did you mean 'lora_path'?"),
    ({"garbage": {"a": 1}}, "unknown field 'garbage'"),
    ({"return_routed_experts": "yes"}, "invalid value for 'return_routed_experts'"),
    ({"text": None, "input_embeds": [[0.1, 0.2]]}, "input_embeds is not supported: pass text or input_ids"),
])
def test_bad_fields_are_a_clear_400(http, extra, message):
    response = http.post("/generate", json={"text": PROMPT, "sampling_params": SAMPLING, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(message)
