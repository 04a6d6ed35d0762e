"""How the real server ends, with requests in flight: SIGTERM drains for at most
--graceful-shutdown-timeout, then ends what still runs cleanly (an error event and
`data: [DONE]` for a stream, a JSON error otherwise); a second Ctrl-C does so at once; a
dead engine process makes every request a 503 and the server exit non-zero. Each test
starts its own server in a subprocess (each ends it)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from server_process import engine_pid, free_port, server_load, start_server
from lab.server_overhead import wait_healthy

LONG = {"max_tokens": 3000, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}]


class _Server:
    def __init__(self, tmp_path, *flags: str):
        self.log_path = tmp_path / "server.log"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        with open(self.log_path, "w") as log:
            self.proc = start_server(self.port, "--max-total-tokens", "4096", *flags, log=log)
        wait_healthy(self.proc, self.base_url)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the server did not exit within {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def servers(tmp_path):
    started = []

    def start(*flags: str) -> _Server:
        started.append(_Server(tmp_path, *flags))
        return started[-1]

    yield start
    for server in started:
        server.close()


class _InFlight:
    """A streaming chat and a non-streaming completion, each read on its own thread."""

    def __init__(self, base_url: str):
        self.events: list[tuple[float, str]] = []    # (arrival time, data of a `data:` line)
        self.plain: httpx.Response | None = None
        self.threads = [threading.Thread(target=self._stream, args=(base_url,), daemon=True),
                        threading.Thread(target=self._complete, args=(base_url,), daemon=True)]
        for thread in self.threads:
            thread.start()

    def _stream(self, base_url: str) -> None:
        body = {"messages": CHAT, "stream": True, **LONG}
        with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=300) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    self.events.append((time.monotonic(), line[6:]))

    def _complete(self, base_url: str) -> None:
        body = {"prompt": "Once upon a time, in a quiet village by the sea,", **LONG}
        self.plain = httpx.post(base_url + "/v1/completions", json=body, timeout=300)

    def wait_running(self, base_url: str, timeout: float = 120) -> None:
        """Until both run in the engine and the stream has sent a few chunks."""
        deadline = time.monotonic() + timeout
        while len(self.events) < 3 or server_load(base_url)["num_running"] < 2:
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.1)

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)
            assert not thread.is_alive(), "a request did not end"

    def ending(self) -> SimpleNamespace:
        """The stream's error event (it must be the last but one, before [DONE]) and its time."""
        assert self.events[-1][1] == "[DONE]", self.events[-3:]
        at, data = self.events[-2]
        return SimpleNamespace(error=json.loads(data)["error"], at=at)


def test_sigterm_drains_for_the_graceful_shutdown_timeout_then_ends_requests_cleanly(servers):
    server = servers("--graceful-shutdown-timeout", "3")
    flight = _InFlight(server.base_url)
    flight.wait_running(server.base_url)
    signalled = time.monotonic()
    streamed = len(flight.events)
    server.proc.send_signal(signal.SIGTERM)
    flight.join(timeout=60)
    ending = flight.ending()
    assert ending.error["code"] == 503 and "graceful-shutdown timeout" in ending.error["message"]
    assert 3 <= ending.at - signalled < 20            # drained, then cut
    assert len(flight.events) - 2 > streamed          # the stream went on during the drain
    assert flight.plain.status_code == 503 and "graceful-shutdown timeout" in flight.plain.json()["error"]["message"]
    assert server.wait_exit(timeout=90) == 128 + signal.SIGTERM
    log = server.log_path.read_text()
    assert "nanobind" not in log and "leaked" not in log, log[-3000:]    # a quiet shutdown
    assert "Traceback" not in log, log[-3000:]


def test_a_second_ctrl_c_ends_running_requests_cleanly(servers):
    server = servers("--graceful-shutdown-timeout", "inf")   # the drain alone would wait for them
    flight = _InFlight(server.base_url)
    flight.wait_running(server.base_url)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(1.5)
    assert flight.plain is None and flight.events[-1][1] != "[DONE]"   # still draining
    interrupted = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    flight.join(timeout=60)
    ending = flight.ending()
    assert ending.error["code"] == 503 and "interrupted" in ending.error["message"]
    assert ending.at - interrupted < 15
    assert flight.plain.status_code == 503 and flight.plain.headers["content-type"] == "application/json"
    assert server.wait_exit(timeout=90) == 130
    assert "Traceback" not in server.log_path.read_text()


def test_a_dead_engine_answers_503_then_the_server_exits_non_zero(servers):
    server = servers()
    flight = _InFlight(server.base_url)
    flight.wait_running(server.base_url)
    os.kill(engine_pid(server.proc.pid), signal.SIGKILL)
    flight.join(timeout=60)
    ending = flight.ending()
    assert ending.error["code"] == 503 and "SIGKILL" in ending.error["message"]
    assert flight.plain.status_code == 503 and "SIGKILL" in flight.plain.json()["error"]["message"]
    assert "Error" not in ending.error["message"] + flight.plain.text     # no internal class name
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        stream = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "max_tokens": 5})
        assert stream.status_code == 503 and stream.json()["error"]["type"] == "server_error"
        plain = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert plain.status_code == 503
        assert client.get("/health").status_code == 503
        info = client.get("/get_server_info").json()
        assert info["num_running"] == info["num_waiting"] == 0
        assert 'specserve:num_running_reqs{model_name="SmolLM2-135M-Instruct"} 0.0' in client.get("/metrics").text
    assert server.wait_exit(timeout=60) == 1        # for a supervisor to restart it


def test_a_cut_turns_waits_on_the_engine_into_503s_and_leaves_other_cancellations_alone():
    from specserve.server.drain import Drain
    from specserve.server.protocol import APIError

    async def scenario():
        drain = Drain()

        async def wait_on_the_engine():
            async with drain.cuttable():
                await asyncio.sleep(60)

        cut, left = asyncio.ensure_future(wait_on_the_engine()), asyncio.ensure_future(wait_on_the_engine())
        await asyncio.sleep(0.01)
        left.cancel()                  # its client left: a cancellation, whatever the drain does
        drain.cut("closing")
        results = await asyncio.gather(cut, left, return_exceptions=True)
        assert isinstance(results[0], APIError) and results[0].status == 503 and results[0].message == "closing"
        assert isinstance(results[1], asyncio.CancelledError)
        with pytest.raises(APIError, match="closing"):   # a wait that starts after the cut
            async with drain.cuttable():
                pass

    asyncio.run(scenario())
