"""Where one decode step's time goes: `python -m specserve.bench.profile_step --model M`
runs plain and NGRAM steps of one request straight on the EngineCore and prints the wall
time per step, the GPU time of the forward, whether a CUDA graph served it, and cProfile's
top entries."""
from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time

import torch


def measure(model: str, speculative: str | None, graphs: bool, steps: int) -> None:
    from specserve.engine.engine import Engine
    kwargs = dict(speculative_algorithm=speculative, speculative_num_draft_tokens=8) if speculative else {}
    engine = Engine(model_path=model, log_level="warning", disable_cuda_graph=not graphs, max_total_tokens=200_000, **kwargs)
    engine.shutdown()  # drive the core from this thread
    core = engine.core
    prompt = engine.tokenizer("def quicksort(xs):\n    " * 20).input_ids
    req = engine._make_request(prompt, {"temperature": 0, "max_new_tokens": 4000, "ignore_eos": True}, False, 0, None)
    core.add_request(req)
    replays = {"n": 0}
    if core.runner.graphs is not None:
        original = core.runner.graphs.replay

        def counted(*args, **kw):
            replays["n"] += 1
            return original(*args, **kw)
        core.runner.graphs.replay = counted
    for _ in range(10):
        core.step()
    forward_ms = []
    original_verify = core.runner.verify

    def timed_verify(*args, **kw):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = original_verify(*args, **kw)
        torch.cuda.synchronize()
        forward_ms.append((time.perf_counter() - start) * 1e3)
        return out
    core.runner.verify = timed_verify
    tokens_before = len(req.output_ids)
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    core.runner.verify = original_verify
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        core.step()
    profile.disable()
    tokens = (len(req.output_ids) - tokens_before) / 2
    print(f"== {speculative or 'plain'} graphs={graphs}: {wall:.2f} ms/step wall (timed), forward {sorted(forward_ms)[len(forward_ms) // 2]:.2f} ms median, "
          f"{tokens / steps:.2f} tokens/step, graph replays {replays['n']}", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(8)
    del engine, core
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=100)
    ns = parser.parse_args()
    for speculative, graphs in ((None, True), (None, False), ("NGRAM", True)):
        measure(ns.model, speculative, graphs, ns.steps)


if __name__ == "__main__":
    main()
