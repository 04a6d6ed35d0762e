"""Prefill depth cost: what a paced prompt chunk costs as it goes deeper into a long prompt,
against a decode step of the streams beside it, stepped by hand (no step-loop thread).

    python -m lab.prefill_depth_cost [--streams 8] [--stream-prompt 300] [--prompt-tokens 4000]
        [--chunks 4,16,64] [--gather select,index] [--threads 1] [--pairs 5] [ServerArgs flags]

The streams decode, the long prompt arrives; at each depth of DEPTHS its chunks of each
size (the pacer bypassed) alternate with decode steps as the scheduler runs them. Each step's cost
is the step thread's CPU time (with --threads 1, all of its compute; other processes on
the machine do not count), so the fixed part (paid whatever the chunk's size) and the
per-token part can be read off at each depth. --gather picks the attention backend's K/V
gather: `select` (the product's index_select over slot rows) or `index` (advanced
indexing, element by element, as before).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from specserve.args import ServerArgs

DEPTHS = (0, 1000, 2000, 3000, 4000)
GATHERS = ("select", "index")


def _use_gather(kind: str) -> None:
    from specserve.attention import torch_native
    if not hasattr(torch_native, "_product_gather"):
        torch_native._product_gather = torch_native.gather_slots
    torch_native.gather_slots = (torch_native._product_gather if kind == "select"
                                 else lambda buffer, slots: buffer[slots])


def _timed_step(core) -> tuple[float, int]:
    """One step's CPU time and the prompt tokens it carried."""
    start = time.thread_time()
    core.step()
    return time.thread_time() - start, core.scheduler._last_step[0]


def _steps_at(core, chunk: int, pairs: int) -> tuple[float, float]:
    """Median CPU time of a prefill step of `chunk` tokens and of a decode step, over `pairs` of each."""
    core.scheduler.pacer.budget = lambda decoding: chunk
    prefill, decode = [], []
    while len(prefill) < pairs or len(decode) < pairs:
        seconds, prompt_tokens = _timed_step(core)
        (prefill if prompt_tokens else decode).append(seconds)
    return statistics.median(prefill), statistics.median(decode)


def measure(engine, chunks: list[int], gathers: list[str], streams: int, stream_prompt: int,
            prompt_tokens: int, pairs: int) -> list[tuple[int, int, str, float, float]]:
    """(depth, chunk, gather, prefill-step CPU s, decode-step CPU s) at each depth of DEPTHS
    below prompt_tokens; between depths the prompt moves on in large chunks."""
    core = engine.core
    params = {"temperature": 0.0, "max_new_tokens": 100_000, "ignore_eos": True}
    vocab = core.runner.config.vocab_size
    ids = lambda n, seed: [(seed * 31 + i * 7919) % (vocab - 1000) + 500 for i in range(n)]
    running = [engine._make_request(ids(stream_prompt, s), params, False, 0, f"s{s}") for s in range(streams)]
    for req in running:
        core.add_request(req)
    while not all(r.output_ids for r in running):
        core.step()
    long_prompt = engine._make_request(ids(prompt_tokens, 99), {**params, "max_new_tokens": 1}, False, 0, "long")
    core.add_request(long_prompt)
    rows = []
    try:
        for depth in (d for d in DEPTHS if d < prompt_tokens - pairs * max(chunks)):
            core.scheduler.pacer.budget = lambda decoding: 256
            while long_prompt.kv_len < depth:
                core.step()
            for chunk in chunks:
                for gather in gathers:   # side by side: what other processes take moves both alike
                    _use_gather(gather)
                    rows.append((long_prompt.kv_len, chunk, gather, *_steps_at(core, chunk, pairs)))
    finally:
        del core.scheduler.pacer.budget
        for req in running + [long_prompt]:
            core.abort(req.rid)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.prefill_depth_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt", type=int, default=300)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--chunks", default="4,16,64")
    parser.add_argument("--gather", default=",".join(GATHERS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pairs", type=int, default=5, help="prefill and decode steps timed per point")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    import torch
    torch.set_num_threads(ns.threads)
    from specserve.engine.engine import Engine
    server_args = ServerArgs.from_cli_args(ns).replace(log_level="warning", disable_radix_cache=True)
    engine = Engine(**dataclasses.asdict(server_args))
    engine.shutdown()   # the step loop stops: this thread steps the core
    print("depth  chunk  gather   prefill step ms  decode step ms  (median CPU time)")
    for depth, chunk, gather, prefill_s, decode_s in measure(
            engine, [int(c) for c in ns.chunks.split(",")], ns.gather.split(","), ns.streams, ns.stream_prompt,
            ns.prompt_tokens, ns.pairs):
        print(f"{depth:5d}  {chunk:5d}  {gather:<7}  {prefill_s * 1000:15.1f}  {decode_s * 1000:14.1f}", flush=True)

if __name__ == "__main__":
    main()
