"""Host cost per streamed token at high concurrency, on the CPU.

    python -m lab.stream_host_cost [--concurrency 64] [--output-len 128]
        [--rounds 2] [--py-spy PATH_TO_PY_SPY] [--profile-out stacks.txt]

A tiny random model (hidden 32, 2 layers, SmolLM2's 49k-token byte-level BPE tokenizer)
makes the forward cheap, so what a step costs on top of it is host work: the step loop's
bookkeeping, detokenizing, handing outputs to the HTTP handlers, building each SSE chunk
and writing it. The same prompts run through the offline Engine (one async_generate per
request, all at once) and through the server's streaming /v1/completions, `--concurrency`
at a time. The server runs its engine in a child process (launch_server's split): each
round prints the CPU time per streamed token of the HTTP process's event loop, of its other
threads (the engine reader, tokenizing) and of the engine process (robust to a shared
machine's load, unlike tok/s); with `--py-spy`, both processes are sampled during the last
round and the samples are split by stage (`STAGES`) into host microseconds per streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import os
import signal
import subprocess
import time

from specserve.args import ServerArgs
from lab.server_overhead import (offline_tokens_per_s, pick_prompts, server_tokens_per_s, start_server,
                                             wait_healthy)

MODEL_DIR = "/tmp/specserve-stream-host-cost"
MODE = "/v1/completions (stream)"
SAMPLE_RATE = 1000   # py-spy samples per second
# (stage, a substring of a frame "function (file)"); a sample counts for the deepest frame that
# matches one (the first match in this list for that frame), so a stage's own callees (json
# inside sse, say) count for the inner stage
STAGES = [
    ("model forward", "specserve/model/"),
    ("sampling", "specserve/sampling/"),
    ("engine step (scheduler, runner, commit)", "specserve/engine/core.py"),
    ("engine step (scheduler, runner, commit)", "specserve/runner/"),
    ("detokenize", "detokenizer.py"),
    ("output dicts (engine thread)", "specserve/engine/output.py"),
    ("hand-off to the event loop", "call_soon_threadsafe"),
    ("hand-off to the event loop", "_write_to_self"),
    ("hand-off to the event loop", "loop_mailbox.py"),
    ("pipe between the processes (pickle, send, recv)", "multiprocessing/connection"),
    ("pipe between the processes (pickle, send, recv)", "engine_worker.py"),
    ("pipe between the processes (pickle, send, recv)", "engine_process.py"),
    ("engine loop", "specserve/engine/engine.py"),
    ("handlers (openai_api, state, metrics)", "specserve/server/"),
    ("SSE JSON encode", "json/"),
    ("starlette StreamingResponse", "starlette/"),
    ("uvicorn / h11 / transport writes", "uvicorn/"),
    ("uvicorn / h11 / transport writes", "_SelectorSocketTransport.write"),
    ("asyncio event loop", "asyncio/"),
]


def make_model_dir(directory: str = MODEL_DIR) -> str:
    """Random weights of a tiny Qwen2 with SmolLM2's tokenizer (made once; ids stay below its vocab)."""
    if os.path.isfile(os.path.join(directory, "model.safetensors")):
        return directory
    import torch

    from specserve.bench.random_model import SHAPES, write_random_model
    from specserve.model.loader import default_model_path, load_checkpoint
    SHAPES.setdefault("tiny-49k", dict(SHAPES["qwen2.5-coder-0.5b"], hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       vocab_size=49152, max_position_embeddings=2048))
    write_random_model(directory, "tiny-49k", dtype=torch.float32, device="cpu")
    load_checkpoint(default_model_path(), dtype=torch.float32).tokenizer.save_pretrained(directory)
    return directory


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the server `pid`'s main thread (uvicorn's event loop), of
    its other threads together (the engine reader, tokenizing), and of its child processes
    (the engine: step loop, torch's threads; Linux only)."""
    totals: collections.Counter[str] = collections.Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = "event loop" if tid == str(pid) else "http other threads"
        totals[name] += _cpu_s(f"/proc/{pid}/task/{tid}/stat")
    for child in _child_pids(pid):
        totals["engine process"] += _cpu_s(f"/proc/{child}/stat")
    return totals


def _cpu_s(stat_path: str) -> float:
    try:
        with open(stat_path) as f:
            parts = f.read().rsplit(")", 1)[1].split()
    except OSError:   # it ended meanwhile
        return 0.0
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def _child_pids(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == pid:
                children.append(int(entry))
    return children


def stage_of(frames: list[str]) -> str:
    """"thread: stage" for one sample's frames (root first)."""
    stack = ";".join(frames)
    # py-spy cannot always walk the event loop's stack to its root: whatever is not the engine process's
    thread = "engine" if "Engine._loop" in stack or "serve_engine" in stack else "http"
    for frame in reversed(frames):
        for stage, marker in STAGES:
            if marker in frame:
                return f"{thread}: {stage}"
    return f"{thread}: other"


def breakdown(stacks_path: str, tokens: int) -> dict[str, float]:
    """Microseconds per streamed token for each stage, from py-spy's raw (collapsed) stacks."""
    samples: collections.Counter[str] = collections.Counter()
    with open(stacks_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            samples[stage_of(stack.split(";"))] += int(count)
    return {stage: n / SAMPLE_RATE / tokens * 1e6 for stage, n in samples.most_common()}


async def _server_round(base_url: str, prompts: list[str], output_len: int, concurrency: int) -> float:
    return await server_tokens_per_s(base_url, MODE, prompts, output_len, concurrency)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.stream_host_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--py-spy", default=None, help="py-spy executable: sample the server in the last round")
    parser.add_argument("--profile-out", default="/tmp/stream_host_cost_stacks.txt")
    ns = parser.parse_args(argv)
    server_args = ServerArgs(model_path=make_model_dir(), dtype="float32", device="cpu", log_level="warning",
                             max_total_tokens=ns.concurrency * (ns.output_len + 256))
    prompts = pick_prompts(ns.concurrency, max_chars=300)
    tokens = len(prompts) * ns.output_len

    from specserve.engine.engine import Engine
    proc, base_url = start_server(server_args)
    try:
        engine = Engine(**vars(server_args))
        wait_healthy(proc, base_url)
        asyncio.run(offline_tokens_per_s(engine, prompts, 8, ns.concurrency))   # warm both
        asyncio.run(_server_round(base_url, prompts, 8, ns.concurrency))
        for round_index in range(ns.rounds):
            offline = asyncio.run(offline_tokens_per_s(engine, prompts, ns.output_len, ns.concurrency))
            spy = None
            if ns.py_spy and round_index == ns.rounds - 1:
                spy = subprocess.Popen([ns.py_spy, "record", "--pid", str(proc.pid), "--rate", str(SAMPLE_RATE),
                                        "--format", "raw", "--nonblocking", "--subprocesses", "-o", ns.profile_out],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)   # py-spy attaches
            cpu_before = thread_cpu_s(proc.pid)
            served = asyncio.run(_server_round(base_url, prompts, ns.output_len, ns.concurrency))
            cpu = {name: (s - cpu_before.get(name, 0.0)) / tokens * 1e6 for name, s in thread_cpu_s(proc.pid).items()}
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            print(f"round {round_index + 1}: offline {offline:8.1f} tok/s, server stream {served:8.1f} tok/s "
                  f"({served / offline:.1%}); server CPU us per token: "
              + ", ".join(f"{name} {us:.1f}" for name, us in sorted(cpu.items())), flush=True)
        engine.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if ns.py_spy:
        print(f"\nserver and engine processes, host us per streamed token ({tokens} tokens; py-spy at {SAMPLE_RATE} Hz, "
              f"non-idle samples of all threads):")
        for stage, us in breakdown(ns.profile_out, tokens).items():
            print(f"  {stage:<42} {us:8.1f}")


if __name__ == "__main__":
    main()
