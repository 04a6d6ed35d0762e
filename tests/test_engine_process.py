"""EngineProcess: the engine in a child process behaves as the in-process Engine does (same
greedy outputs, chunks in order, the same errors), aborts free its KV slots in the child,
a child that dies fails every open request and the health check at once, and a start-up
failure is raised in the parent. A tiny random model keeps the child's start to seconds."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient

from specserve.args import ServerArgs
from specserve.engine.engine_process import EngineProcess
from specserve.errors import EngineFatalError, ModelNotFoundError
from specserve.server.http import create_app
from tests.spec_fixtures import make_tiny_directory, tiny_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44], [100], [7, 7, 7, 7]]


def process_args(path, **extra) -> ServerArgs:
    return ServerArgs(model_path=str(path), dtype="float32", device="cpu", log_level="warning",
                      max_total_tokens=1024, **extra)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_directory(path, vocab_size=512)
    return path


@pytest.fixture(scope="module")
def remote(model_dir):
    engine = EngineProcess(process_args(model_dir))
    yield engine
    engine.shutdown()


def wait_until_idle(engine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = engine.load()
        if (load["num_running"] == load["num_waiting"] == 0 and load["kv_free_slots"] == load["kv_total_slots"]) \
                or time.monotonic() > deadline:
            return load
        time.sleep(0.02)


async def collect(stream) -> list[dict]:
    return [chunk async for chunk in stream]


def test_same_greedy_outputs_and_chunk_order_as_in_process(model_dir, remote):
    local = tiny_engine(model_dir, max_total_tokens=1024)
    try:
        params = [{**GREEDY, "max_new_tokens": n} for n in (9, 4, 12, 1)]
        expected = local.generate(input_ids=PROMPTS, sampling_params=params)
    finally:
        local.shutdown()

    async def scenario():
        batch = await remote.async_generate(input_ids=PROMPTS, sampling_params=params)
        streams = [await remote.async_generate(input_ids=ids, sampling_params=p, stream=True)
                   for ids, p in zip(PROMPTS, params)]
        return batch, await asyncio.gather(*(collect(s) for s in streams))

    batch, streamed = asyncio.run(scenario())
    for want, got, chunks in zip(expected, batch, streamed):
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
        assert [t for c in chunks for t in c["output_ids"]] == want["output_ids"]
        assert "".join(c["text"] for c in chunks) == want["text"]
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(range(1, len(chunks) + 1))
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert remote.get_server_info()["max_total_tokens"] == 1024 and remote.vocab_size == 512


def test_the_same_errors_as_in_process(remote):
    async def scenario():
        with pytest.raises(ValueError, match=r"input_ids must be integers in \[0, 512\)"):
            await remote.async_generate(input_ids=[1, 512], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="unknown sampling parameter"):
            await remote.async_generate(input_ids=[1, 2], sampling_params={"temprature": 0})
        long = await remote.async_generate(input_ids=[3, 4], stream=True, rid="twice",
                                           sampling_params={**GREEDY, "max_new_tokens": 500})
        await long.__anext__()
        duplicate = await remote.async_generate(input_ids=[3, 4], stream=True, rid="twice", sampling_params=GREEDY)
        with pytest.raises(ValueError, match="twice"):   # refused in the child, as the engine refuses it
            await duplicate.__anext__()
        rest = await collect(long)   # the first request with that rid goes on unharmed
        assert rest[-1]["meta_info"]["completion_tokens"] == 500

    asyncio.run(scenario())


def test_a_request_whose_caller_leaves_is_aborted_in_the_child(remote):
    """Its rid is free again at once (the engine refuses a rid that is still running), and its
    KV slots are freed."""
    long = {**GREEDY, "max_new_tokens": 500}

    async def scenario():
        stream = await remote.async_generate(input_ids=[9, 10, 11], stream=True, rid="streamed", sampling_params=long)
        for _ in range(3):
            await stream.__anext__()
        busy = remote.load()
        await stream.aclose()   # what a client disconnect does to the handler's iterator
        await remote.async_generate(input_ids=[9, 10], rid="streamed", sampling_params=GREEDY)
        waiting = asyncio.ensure_future(remote.async_generate(input_ids=[12, 13], rid="whole", sampling_params=long))
        while remote.load()["num_running"] == 0:
            await asyncio.sleep(0.005)
        waiting.cancel()        # what a client disconnect does to a non-streaming handler
        await asyncio.gather(waiting, return_exceptions=True)
        await remote.async_generate(input_ids=[12, 13], rid="whole", sampling_params=GREEDY)
        return busy

    busy = asyncio.run(scenario())
    assert busy["num_running"] == 1 and busy["kv_free_slots"] < busy["kv_total_slots"]
    idle = wait_until_idle(remote)
    assert idle["num_running"] == 0 and idle["kv_free_slots"] == idle["kv_total_slots"]


def test_flush_cache_runs_in_the_child(remote):
    asyncio.run(remote.async_generate(input_ids=list(range(20, 60)), sampling_params={**GREEDY, "max_new_tokens": 2}))
    wait_until_idle(remote)
    assert remote.load()["kv_cached_slots"] > 0
    assert remote.flush_cache() > 0
    assert remote.load()["kv_cached_slots"] == 0


def test_a_killed_engine_process_fails_open_requests_and_the_health_check(model_dir):
    engine = EngineProcess(process_args(model_dir, skip_server_warmup=True))
    try:
        async def scenario():
            stream = await engine.async_generate(input_ids=[1, 2, 3], stream=True,
                                                 sampling_params={**GREEDY, "max_new_tokens": 900})
            await stream.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineFatalError, match="killed by SIGKILL"):
                await asyncio.wait_for(collect(stream), timeout=10)

        asyncio.run(scenario())
        with pytest.raises(EngineFatalError, match="killed by SIGKILL"):
            engine.flush_cache()
        with TestClient(create_app(engine), raise_server_exceptions=False) as http:
            health = http.get("/health")
            assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
            refused = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert refused.status_code == 503 and "the engine stopped" in refused.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_shutdown_reaps_the_child_and_refuses_new_requests(model_dir):
    engine = EngineProcess(process_args(model_dir, skip_server_warmup=True))
    pid = engine.pid
    engine.shutdown()
    assert engine._process.exitcode == 0 and not os.path.exists(f"/proc/{pid}")   # exited by itself, and reaped
    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(engine.async_generate(input_ids=[1, 2], sampling_params=GREEDY))


def test_a_start_up_failure_is_raised_in_the_parent_before_the_server_starts(tmp_path):
    from specserve.server.launch import launch_server
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        launch_server(process_args(tmp_path / "missing.gguf"))
    assert time.monotonic() - started < 60


def test_the_server_process_never_imports_the_engine():
    """torch (and with it any CUDA initialisation) stays in the engine process."""
    code = ("import sys; import specserve.server.launch, specserve.server.http, specserve.engine.engine_process; "
            "assert 'torch' not in sys.modules and 'specserve.engine.engine' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
