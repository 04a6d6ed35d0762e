"""Load and faults against the real server (loopback only, a small KV pool): mixed
endpoints at high concurrency with preemption, clients that leave mid-stream, mid-request
and mid-upload, and every kind of malformed request (malformed_requests.py), all at once.
Afterwards: no 5xx, no traceback in the server's log, no leaked KV slot, greedy (and
seeded) outputs equal to the same requests run alone, and the server still healthy."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from malformed_requests import malformed_requests
from server_process import free_port, start_server, stop_server, wait_idle
from lab.server_overhead import wait_healthy

# 32 requests of 20-50 tokens at once do not fit 384 slots: the newest are preempted
SERVER_FLAGS = ("--max-total-tokens", "384", "--max-running-requests", "32")
CONCURRENCY = 32
MAX_TOKENS = 12
PROMPTS = [f"Question {i}: what is {i} times {i + 3}? Answer:" for i in range(4)] + [
    "Once upon a time, in a quiet village by the sea,", "def fibonacci(n):",
    "The three primary colors are", "Translate to French: good morning, my friend"]
CHATS = [[{"role": "user", "content": c}] for c in ("Name three colors.", "What is 2 + 2?", "Say hello.", "Count to five.")]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234, "max_new_tokens": MAX_TOKENS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    port = free_port()
    with open(log_path, "w") as log:
        proc = start_server(port, *SERVER_FLAGS, log=log)
        try:
            base_url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, base_url)
            model = httpx.get(base_url + "/v1/models").json()["data"][0]["id"]
            yield SimpleNamespace(base_url=base_url, port=port, model=model, log_path=log_path)
        finally:
            stop_server(proc)


def test_load_and_faults(server):
    start = time.perf_counter()
    solo = asyncio.run(_solo_references(server))
    loaded = time.perf_counter()
    outcome = asyncio.run(_load(server, solo))
    print(f"solo references {loaded - start:.1f} s, load {time.perf_counter() - loaded:.1f} s")
    assert outcome.server_errors == [], outcome.server_errors[:3]
    assert outcome.mismatches == [], outcome.mismatches[:3]
    assert outcome.malformed_kinds >= 40 and outcome.aborts >= 24
    info = wait_idle(server.base_url, timeout=30)
    assert info["kv_free_slots"] == info["kv_total_slots"] and info["num_running"] == info["num_waiting"] == 0
    metrics = httpx.get(server.base_url + "/metrics").text
    preemptions = [line for line in metrics.splitlines() if line.startswith("specserve:num_preemptions_total")]
    # Whether this load preempts depends on timing (admission leaves each decoding request
    # room for its next token): it did in most runs, but not in two full-suite runs on a
    # loaded machine. Preemption's exactness is held deterministically by
    # test_generation.py::test_chunked_prefill_and_preemption_keep_outputs; here it is reported.
    print(preemptions[0])
    # healthy afterwards, and still right
    assert httpx.get(server.base_url + "/health_generate", timeout=60).status_code == 200
    again = httpx.post(server.base_url + "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}, timeout=60)
    assert again.json()["output_ids"] == solo.generate[0]["output_ids"]
    log = server.log_path.read_text()
    for marker in ("Traceback", "exception was never retrieved", "Exception in ASGI application", "ERROR"):
        assert marker not in log, log[-3000:]


# ---- the same requests, one at a time ----
async def _solo_references(server) -> SimpleNamespace:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
        generate = [(await http.post("/generate", json={"text": p, "sampling_params": GREEDY})).json() for p in PROMPTS]
        seeded = [(await http.post("/generate", json={"text": p, "sampling_params": SEEDED})).json() for p in PROMPTS[:4]]
        chat = [(await http.post("/v1/chat/completions", json=_chat_body(server, m, stream=False))).json()
                ["choices"][0]["message"]["content"] for m in CHATS]
    return SimpleNamespace(generate=generate, seeded=seeded, chat=chat)


def _chat_body(server, messages, stream: bool) -> dict:
    return {"model": server.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}


# ---- everything at once ----
async def _load(server, solo) -> SimpleNamespace:
    outcome = SimpleNamespace(server_errors=[], mismatches=[], malformed_kinds=0, aborts=0)
    limit = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY + 16, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
        def expect(name: str, got, want) -> None:
            if got != want:
                outcome.mismatches.append((name, got, want))

        async def bounded(job):
            async with limit:
                try:
                    await job
                except httpx.HTTPStatusError as error:
                    if error.response.status_code >= 500:
                        outcome.server_errors.append((str(error.request.url), error.response.text[:300]))
                    else:
                        outcome.mismatches.append(("refused", str(error.request.url), error.response.text[:300]))

        jobs = []
        for i, prompt in enumerate(PROMPTS):
            text, ids = solo.generate[i]["text"], solo.generate[i]["output_ids"]
            jobs += [_completion(http, server, prompt, False, {}, lambda got, t=text: expect("completion", got, t)),
                     _completion(http, server, prompt, True, {}, lambda got, t=text: expect("stream", got, t)),
                     _completion(http, server, prompt, False, {"temperature": 1.0, "top_p": 0},
                                 lambda got, t=text: expect("top_p=0", got, t)),
                     _native(http, prompt, GREEDY, False, lambda got, w=ids: expect("generate", got, w)),
                     _native(http, prompt, GREEDY, True, lambda got, w=ids: expect("generate stream", got, w))]
            if i < len(solo.seeded):
                jobs.append(_native(http, prompt, SEEDED, i % 2 == 0,
                                    lambda got, w=solo.seeded[i]["output_ids"]: expect("seeded", got, w)))
            if i < len(CHATS):
                for stream in (False, True):
                    jobs.append(_chat(http, server, CHATS[i], stream, lambda got, w=solo.chat[i]: expect("chat", got, w)))
        for i, prompt in enumerate(PROMPTS * 3):
            jobs.append(_leave(http, server, prompt, i % 4, outcome))
        malformed = [_malformed(http, case, outcome) for case in malformed_requests(server.model)]
        outcome.malformed_kinds = len(malformed)
        await asyncio.gather(*(bounded(job) for job in jobs), *malformed)
    return outcome


async def _completion(http, server, prompt, stream, extra, check) -> None:
    body = {"model": server.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            **extra}
    if not stream:
        response = (await http.post("/v1/completions", json=body)).raise_for_status()
        return check(response.json()["choices"][0]["text"])
    check("".join(event["choices"][0]["text"] for event in await _events(http, "/v1/completions", body)))


async def _chat(http, server, messages, stream, check) -> None:
    body = _chat_body(server, messages, stream)
    if not stream:
        response = (await http.post("/v1/chat/completions", json=body)).raise_for_status()
        return check(response.json()["choices"][0]["message"]["content"])
    check("".join(e["choices"][0]["delta"].get("content") or "" for e in await _events(http, "/v1/chat/completions", body)))


async def _native(http, prompt, params, stream, check) -> None:
    body = {"text": prompt, "sampling_params": params, "stream": stream}
    if not stream:
        return check((await http.post("/generate", json=body)).raise_for_status().json()["output_ids"])
    check((await _events(http, "/generate", body))[-1]["output_ids"])


async def _events(http, path: str, body: dict) -> list[dict]:
    async with http.stream("POST", path, json=body) as response:
        response.raise_for_status()
        lines = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and not any('"error"' in line for line in lines), lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


# ---- clients that leave ----
async def _leave(http, server, prompt: str, how: int, outcome) -> None:
    """0-2: mid-stream (completions, chat, /generate), after two events; 3: a non-streaming
    request given up; also, alternately, a client that stops halfway through its upload."""
    outcome.aborts += 1
    body = {"model": server.model, "prompt": prompt, "max_tokens": 200, "ignore_eos": True}
    if how == 3:
        try:
            await http.post("/v1/completions", json=body, timeout=0.5)
        except httpx.TimeoutException:
            pass
        return await _upload_and_leave(server.port)
    path, body = [("/v1/completions", body),
                  ("/v1/chat/completions", {**_chat_body(server, CHATS[0], True), "max_tokens": 200}),
                  ("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 200}})][how]
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        response.raise_for_status()
        events = 0
        async for line in response.aiter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break


async def _upload_and_leave(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{\"prompt\": \"half a bo")
    await writer.drain()
    writer.close()
    await writer.wait_closed()


# ---- malformed input ----
async def _malformed(http, case, outcome) -> None:
    method, path, body = case
    if isinstance(body, bytes):
        response = await http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        response = await http.request(method, path, json=body)
    if response.status_code >= 500 or response.status_code < 400:
        target = outcome.server_errors if response.status_code >= 500 else outcome.mismatches
        target.append((path, repr(body)[:200], response.status_code, response.text[:300]))
        return
    error = response.json()["error"]
    shaped = isinstance(error["message"], str) and error["message"] and "type" in error and "param" in error
    if not shaped:
        outcome.mismatches.append(("error shape", path, repr(body)[:200], error))
