"""The HTTP server end to end: `python -m specserve.launch_server` in a subprocess on a free
port, driven by the official `openai` client and raw HTTP, checked against an offline
Engine in this process (both start once per module, side by side)."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from fake_engine import SLOW_TEXT_RELEASE, FakeEngine
from server_process import free_port, server_load, start_server, stop_server, wait_idle
from lab.server_overhead import wait_healthy


GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def env(request):
    port = free_port()
    proc = start_server(port, "--max-total-tokens", "8192")   # loads while this process loads its offline engine
    try:
        # the session's engine factory reuses an already-loaded checkpoint when another module loaded one
        engine = request.getfixturevalue("engine_factory")(max_total_tokens=8192)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base_url)
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
        yield SimpleNamespace(base_url=base_url, engine=engine, client=client, model=model)
    finally:
        stop_server(proc)


def offline(engine, prompt=None, input_ids=None, **params) -> dict:
    return engine.generate(prompt=prompt, input_ids=input_ids, sampling_params={**GREEDY, **params})


def chat_ids(engine, messages) -> list[int]:
    return engine.tokenizer(engine.apply_chat_template(messages), add_special_tokens=False).input_ids


PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


def test_completion_and_chat_match_offline_engine(env):
    expected = offline(env.engine, PROMPT, max_new_tokens=12)
    out = env.client.completions.create(model=env.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.choices[0].text == expected["text"]
    assert out.choices[0].finish_reason == ("length" if expected["meta_info"]["finish_reason"]["type"] == "length" else "stop")
    assert out.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == expected["meta_info"]["completion_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    expected_chat = offline(env.engine, input_ids=chat_ids(env.engine, CHAT), max_new_tokens=12)
    chat = env.client.chat.completions.create(model=env.model, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected_chat["text"]
    assert chat.usage.prompt_tokens == expected_chat["meta_info"]["prompt_tokens"]
    assert chat.usage.completion_tokens == expected_chat["meta_info"]["completion_tokens"]


def test_streaming_matches_non_streaming(env):
    full = env.client.completions.create(model=env.model, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(env.client.completions.create(model=env.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    full_chat = env.client.chat.completions.create(model=env.model, messages=CHAT, max_tokens=10, temperature=0)
    stream = env.client.chat.completions.create(model=env.model, messages=CHAT, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full_chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full_chat.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)   # no include_usage: no usage chunk


def test_stop_strings(env):
    text = offline(env.engine, PROMPT, max_new_tokens=12)["text"]
    stop = text.split()[2]          # a word from the middle of the greedy output
    out = env.client.completions.create(model=env.model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]
    streamed = env.client.chat.completions.create(model=env.model, messages=CHAT, max_tokens=12, temperature=0,
                                                  stop="\n", stream=True)
    assert "\n" not in "".join(c.choices[0].delta.content or "" for c in streamed)


def test_logprobs(env):
    expected = env.engine.generate(PROMPT, {**GREEDY, "max_new_tokens": 6}, return_logprob=True, top_logprobs_num=2)
    want = [lp for lp, _, _ in expected["meta_info"]["output_token_logprobs"]]
    out = env.client.completions.create(model=env.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == out.usage.completion_tokens == len(want)
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    for token, top, lp in zip(logprobs.tokens, logprobs.top_logprobs, logprobs.token_logprobs):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(lp)   # greedy: the chosen token is the top one
    assert logprobs.text_offset[0] == 0

    chat = env.client.chat.completions.create(model=env.model, messages=CHAT, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert all(c.logprob <= 0 and bytes(c.bytes).decode() == c.token for c in content)

    streamed = list(env.client.chat.completions.create(model=env.model, messages=CHAT, max_tokens=5, temperature=0,
                                                       logprobs=True, stream=True))
    assert [t.logprob for c in streamed[1:] for t in c.choices[0].logprobs.content] == pytest.approx(
        [c.logprob for c in content], abs=1e-4)


def test_native_generate(env):
    expected = offline(env.engine, PROMPT, max_new_tokens=6)
    body = {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6}}
    out = httpx.post(env.base_url + "/generate", json=body, timeout=60).json()
    assert out["text"] == expected["text"] and out["output_ids"] == expected["output_ids"]
    assert out["meta_info"]["completion_tokens"] == 6 and out["meta_info"]["finish_reason"]["type"] == "length"

    ids = env.engine.tokenizer(PROMPT).input_ids
    batch = httpx.post(env.base_url + "/generate", timeout=60, json={
        "input_ids": [ids, ids], "sampling_params": {**GREEDY, "max_new_tokens": 6}, "return_logprob": True}).json()
    assert [b["output_ids"] for b in batch] == [expected["output_ids"]] * 2
    assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 6

    events = []
    with httpx.stream("POST", env.base_url + "/generate", json={**body, "stream": True}, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == expected["text"] and chunks[-1]["output_ids"] == expected["output_ids"]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, 7))   # cumulative, as SGLang


PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(4)] + [
    "Once upon a time", "def fibonacci(n):", "The three primary colors are", "Translate to French: good morning"]


def test_32_concurrent_requests_match_single_requests(env):
    singles = [offline(env.engine, p, max_new_tokens=8) for p in PROMPTS]   # one at a time

    async def run_all():
        async with httpx.AsyncClient(base_url=env.base_url, timeout=120) as http:
            async def completion(prompt, stream):
                body = {"model": env.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
                if not stream:
                    return (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
                text = ""
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            async def native(prompt, max_new_tokens):
                body = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
                return (await http.post("/generate", json=body)).json()["output_ids"]

            jobs = []
            for prompt in PROMPTS:
                jobs += [completion(prompt, False), completion(prompt, True), native(prompt, 5), native(prompt, 7)]
            return await asyncio.gather(*jobs)

    results = iter(asyncio.run(run_all()))
    for single in singles:
        assert next(results) == single["text"]
        assert next(results) == single["text"]
        assert next(results) == single["output_ids"][:5]
        assert next(results) == single["output_ids"][:7]
    info = wait_idle(env.base_url)
    assert info["kv_free_slots"] == info["kv_total_slots"]


def test_client_disconnect_mid_stream_frees_kv_slots(env):
    body = {"model": env.model, "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", env.base_url + "/v1/completions", json=body, timeout=60) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                busy = server_load(env.base_url)
                break
    assert busy["num_running"] == 1 and busy["kv_free_slots"] < busy["kv_total_slots"]
    info = wait_idle(env.base_url)
    assert info["kv_free_slots"] == info["kv_total_slots"] and info["num_running"] == 0

    with pytest.raises(httpx.TimeoutException):    # a non-streaming client that gives up
        httpx.post(env.base_url + "/generate", json={"text": "Tell me a long story.", "sampling_params": {
            "max_new_tokens": 2000, "ignore_eos": True}}, timeout=1.0)
    info = wait_idle(env.base_url)
    assert info["kv_free_slots"] == info["kv_total_slots"] and info["num_running"] == 0


def test_openai_client_sees_api_errors(env):
    """Every kind of bad request is in test_load_and_fault.py; here, the official client's view of two."""
    with pytest.raises(openai.NotFoundError):
        env.client.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError):
        env.client.completions.create(model=env.model, prompt="hi", max_tokens=2, temperature=9)


def test_top_p_zero_is_greedy(env):
    """OpenAI accepts top_p=0: only the likeliest token is left, so the output is greedy."""
    expected = offline(env.engine, PROMPT, max_new_tokens=8)
    out = env.client.completions.create(model=env.model, prompt=PROMPT, max_tokens=8, temperature=1.0, top_p=0)
    assert out.choices[0].text == expected["text"]


def test_info_endpoints_and_metrics(env):
    with httpx.Client(base_url=env.base_url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health_generate").status_code == 200
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == env.model
        assert http.get(f"/v1/models/{env.model}").json()["id"] == env.model
        info = http.get("/get_model_info").json()
        assert info["is_generation"] and info["model_path"].endswith(".gguf")
        server = http.get("/get_server_info").json()
        assert server["max_total_tokens"] == 8192 and server["kv_total_slots"] == 8192 and "num_waiting" in server
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["tokens"] == env.engine.tokenizer(PROMPT).input_ids and tokens["count"] == len(tokens["tokens"])
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
        metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for name in ("num_requests_total", "prompt_tokens_total", "generation_tokens_total", "num_running_reqs",
                 "num_queue_reqs", "token_usage", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_count",
                 "spec_verify_steps_total", "spec_accept_length"):
        assert f"specserve:{name}" in text, name
    generated = [line for line in text.splitlines() if line.startswith("specserve:generation_tokens_total")]
    assert float(generated[0].rsplit(" ", 1)[1]) > 0


# --- in-process, with a fake engine (fake_engine.py) ---
def test_internal_failure_is_a_500_for_that_request_only(caplog):
    """A failure inside the engine: a 500 (or a stream's error event) with a generic message, no
    internal detail (the class name in the engine's message), one traceback in the log."""
    from fastapi.testclient import TestClient

    from specserve.server.http import create_app
    from specserve.server.protocol import INTERNAL_ERROR_MESSAGE
    engine = FakeEngine()
    with TestClient(create_app(engine, served_model_name="fake"), raise_server_exceptions=False) as http:
        failed = http.post("/v1/completions", json={"prompt": "boom boom", "max_tokens": 8})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert failed.json()["error"]["message"] == INTERNAL_ERROR_MESSAGE
        ok = http.post("/v1/completions", json={"model": "fake", "prompt": "hello", "max_tokens": 8})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "hello"
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "boom"}], "max_tokens": 8, "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[-2][6:])["error"] == {"message": INTERNAL_ERROR_MESSAGE, "type": "server_error",
                                                      "param": None, "code": 500}
        assert lines[-1] == "data: [DONE]"
        assert http.post("/generate", json={"text": "fine", "sampling_params": {"max_new_tokens": 2}}).json()["text"] == "fi"
        metrics = http.get("/metrics").text
        assert 'finish_reason="error"' in metrics
    assert "TypeError" not in failed.text + "".join(lines)
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 2 and all("boom" in str(r.exc_info[1]) for r in tracebacks)   # one per request


def test_a_stopped_engine_answers_503_and_fails_its_health_check():
    from fastapi.testclient import TestClient

    from specserve.errors import EngineFatalError
    from specserve.server.http import create_app
    engine = FakeEngine()
    with TestClient(create_app(engine, served_model_name="fake"), raise_server_exceptions=False) as http:
        assert http.get("/health").status_code == 200
        engine.fatal_error = EngineFatalError("tensor-parallel rank 1 (pid 7) was killed by SIGKILL")
        engine.load = lambda: {**FakeEngine().load(), "num_running": 3, "num_waiting": 2}   # its last report

        async def refuse(*args, **kwargs):
            raise EngineFatalError(f"the engine stopped: {engine.fatal_error}")
        engine.async_generate = refuse
        health = http.get("/health")
        assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
        refused = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8})
        assert refused.status_code == 503 and "the engine stopped" in refused.json()["error"]["message"]
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"}), ("/generate", {"text": "hi"})):
            stream = http.post(path, json={**body, "stream": True})   # a status, not a 200 with an error event
            assert stream.status_code == 503 and stream.json()["error"]["type"] == "server_error", path
        info = http.get("/get_server_info").json()
        assert info["num_running"] == info["num_waiting"] == 0
        assert "specserve:num_running_reqs{model_name=\"fake\"} 0.0" in http.get("/metrics").text


def test_api_key():
    from fastapi.testclient import TestClient

    from specserve.server.http import create_app
    with TestClient(create_app(FakeEngine(), api_key="sesame")) as http:
        assert http.get("/health").status_code == 200
        refused = http.post("/v1/completions", json={"prompt": "hi"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        ok = http.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "hi"


def test_long_texts_are_tokenized_off_the_event_loop():
    """A long prompt's tokenization runs on a worker thread: while it is stuck, the event
    loop goes on answering others (were it on the loop, /health would hang with it)."""
    from specserve.server.http import create_app
    from specserve.server.state import INLINE_TEXT_CHARS

    async def scenario():
        transport = httpx.ASGITransport(app=create_app(FakeEngine(), served_model_name="fake"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            slow = asyncio.ensure_future(http.post("/tokenize", json={"prompt": "slow" + "x" * INLINE_TEXT_CHARS}))
            try:
                health = await asyncio.wait_for(http.get("/health"), timeout=10)
                assert health.status_code == 200 and not slow.done()
            finally:
                SLOW_TEXT_RELEASE.set()
            assert (await slow).json()["count"] == 4 + INLINE_TEXT_CHARS

    try:
        asyncio.run(scenario())
    finally:
        SLOW_TEXT_RELEASE.clear()


class _LeavingClient:
    """A request whose client disconnects once `leave` is set."""

    def __init__(self):
        self.leave = asyncio.Event()

    async def receive(self):
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_disconnect_cancels_the_work_and_waits_for_it():
    from specserve.server.disconnect import ClientDisconnected, gather_all, run_unless_disconnected
    wound_down = []

    async def work(name: str, fail_after: float | None = None):
        try:
            if fail_after is not None:
                await asyncio.sleep(fail_after)
                raise RuntimeError(name)
            await asyncio.sleep(60)
        finally:
            wound_down.append(name)     # as the engine stream's clean-up (the abort) runs

    async def scenario():
        client = _LeavingClient()
        asyncio.get_running_loop().call_later(0.05, client.leave.set)
        with pytest.raises(ClientDisconnected):
            await run_unless_disconnected(client, gather_all(work("a"), work("b")))
        assert sorted(wound_down) == ["a", "b"]     # cancelled and finished before the handler returned
        assert await run_unless_disconnected(_LeavingClient(), asyncio.sleep(0, result=7)) == 7
        wound_down.clear()
        with pytest.raises(RuntimeError, match="c"):    # one fails: the other is cancelled, not left running
            await gather_all(work("c", fail_after=0.01), work("d"))
        assert sorted(wound_down) == ["c", "d"]
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(scenario())
