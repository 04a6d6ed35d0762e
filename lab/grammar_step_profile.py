"""Where the engine thread's time goes in the steps a grammar makes dearer, by Python function.

On an H200 (1.5B, schema extraction at 64, plain decoding) a prefill step under a grammar took
~2 ms more than the same prompt's without one: its `after` phase (the plain step launched before
the prefill and read after it) ~0.8-1.2 ms more and its `read` ~0.5-0.9 ms more, with no token
strayed (lab/host_phases.py's phases in the suite's rows). The phases say where in the step, not
what; this profiles it. `python -m lab.grammar_step_profile --model M [--workload W] [--concurrency C]`
runs the suite's structured requests (bench/gpu_suite.py) under their grammars and without them,
each after a warm-up, with cProfile on the engine thread during every step of one kind
(`--steps prefill|plain`), and prints per mode the steps' count and mean wall ms, then the
functions whose own time differs most between the modes (ms a step), then each mode's top
functions by cumulative time. Profiling slows every Python call alike: compare the modes, not
the absolute times with a run's.

`--measure gaps` profiles nothing; it asks whether a dearer decode step is the GPU's or the
host's time. With the grammar, plain steps at 64 took 2.14-2.18 ms against 1.99 without while
the host's work in them (1.6 ms) stayed below the GPU's (2 ms): either the GPU ran longer (the
step's logits copied for a stray's read: 64 x 151k fp32) or the host was late to launch some
steps. CUDA events around every graph replay of a plain step give, per mode, the graph's own
GPU time, and the GPU time from one replay's end to the next's start (the logits copy and the
launch's small copies, and any wait for the host's launch), as mean and percentiles, with the
copy of a (64, vocab) fp32 tensor timed alone beside them. Answered on an H200 (1.5B, ae2b656):
the graph's GPU time is the same with and without the grammar (2.00 ms); between replays 0.040-0.045 ms
against 0.026, the clone (0.022 ms alone); the rest of a constrained step's extra is host time.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import statistics
import time

import torch


def profiled_steps(core_class, kind: str):
    """Wraps core_class._run so that cProfile runs during steps of `kind` ('prefill': a batch
    that extends, 'plain': a decode step); returns (profile holder, counts)."""
    state = {"profile": cProfile.Profile(), "steps": 0, "seconds": 0.0}
    original = core_class._run

    def run(self, batch, kept):
        if batch.is_extend != (kind == "prefill"):
            return original(self, batch, kept)
        start = time.perf_counter()
        state["profile"].enable()
        try:
            return original(self, batch, kept)
        finally:
            state["profile"].disable()
            state["steps"] += 1
            state["seconds"] += time.perf_counter() - start
    core_class._run = run
    return state, lambda: setattr(core_class, "_run", original)


class GraphGaps:
    """CUDA events around each graph replay during plain decode steps (core._run wrapped, as
    profiled_steps does), for the replays' GPU time and the GPU time between consecutive ones;
    a pair is counted only where no other kind of step ran between them."""

    def __init__(self, core_class):
        self.marks: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self.other_steps = 0
        self.steps = 0
        self._in_plain = False
        run, replay = core_class._run, torch.cuda.CUDAGraph.replay
        gaps = self

        def timed_run(core, batch, kept):
            if batch.is_extend:
                gaps.other_steps += 1
                return run(core, batch, kept)
            gaps._in_plain, gaps.steps = True, gaps.steps + 1
            try:
                return run(core, batch, kept)
            finally:
                gaps._in_plain = False

        def timed_replay(graph):
            if not gaps._in_plain:
                return replay(graph)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay(graph)
            end.record()
            gaps.marks.append((start, end, gaps.other_steps))
        core_class._run, torch.cuda.CUDAGraph.replay = timed_run, timed_replay
        self.restore = lambda: (setattr(core_class, "_run", run), setattr(torch.cuda.CUDAGraph, "replay", replay))

    def summary(self) -> dict:
        torch.cuda.synchronize()
        graph = [start.elapsed_time(end) for start, end, _ in self.marks]
        between = [end.elapsed_time(start) for (_, end, seen), (start, _, seen_next) in zip(self.marks, self.marks[1:])
                   if seen == seen_next]
        cuts = lambda xs: {"mean": statistics.fmean(xs), **{f"p{q}": statistics.quantiles(xs, n=100)[q - 1]
                                                             for q in (50, 90, 99)}} if len(xs) > 2 else {}
        return {"plain_steps": self.steps, "replays": len(graph), "graph_ms": cuts(graph), "between_ms": cuts(between),
                "between_over_0.1ms": sum(b > 0.1 for b in between) / max(1, len(between))}


def copy_ms(rows: int, vocab: int, repeats: int = 50) -> float:
    """GPU time of one clone of a (rows, vocab) fp32 tensor."""
    logits = torch.randn(rows, vocab, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    logits.clone()
    start.record()
    for _ in range(repeats):
        logits.clone()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def own_times(profile: cProfile.Profile) -> dict[str, float]:
    """function -> its own (total minus callees') seconds."""
    stats = pstats.Stats(profile).stats
    return {f"{path.rsplit('/', 2)[-1]}:{line}({name})": tt for (path, line, name), (_, _, tt, _, _) in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", default="schema-extraction", choices=["schema-extraction", "agentic-tools"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", default="prefill", choices=["prefill", "plain"])
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--measure", default="profile", choices=["profile", "gaps"])
    ns = parser.parse_args()
    from specserve.bench.agentic import agentic_requests
    from specserve.bench.extraction import extraction_requests
    from specserve.bench.offline import run_turn
    from specserve.bench.structured_requests import encode_request, without_grammar
    from specserve.engine.engine import Engine
    on_gpu = ns.device == "cuda"
    engine = Engine(model_path=ns.model, device=ns.device, dtype="bfloat16" if on_gpu else "float32",
                    log_level="warning", **({"cuda_graph_max_bs": 64} if on_gpu else {}))
    make = agentic_requests if ns.workload == "agentic-tools" else extraction_requests
    timed = [encode_request(engine, r) for r in make(ns.requests, seed=1)]
    warm = [encode_request(engine, r) for r in make(ns.requests, seed=2)]
    for request in timed + warm:   # compiled before anything is timed, as the suite does
        if request.sampling_params:
            engine.generate(input_ids=request.input_ids[:8], sampling_params={**request.sampling_params,
                                                                               "max_new_tokens": 1})
    params = {"temperature": 0, "max_new_tokens": ns.max_new_tokens}
    results = {}
    for mode in ("grammar", "free", "grammar", "free"):
        pick = (lambda r: r) if mode == "grammar" else without_grammar
        asyncio.run(run_turn(engine, [pick(r) for r in warm], params, ns.concurrency, "warm-up"))
        engine.flush_cache()
        if ns.measure == "gaps":
            gaps = GraphGaps(type(engine.core))
            try:
                summary = asyncio.run(run_turn(engine, [pick(r) for r in timed], params, ns.concurrency, mode))
            finally:
                gaps.restore()
            engine.flush_cache()
            print(json.dumps({"mode": mode, "tok_s": round(summary["output_tokens_per_s"]), **gaps.summary()}), flush=True)
            continue
        state, restore = profiled_steps(type(engine.core), ns.steps)
        try:
            summary = asyncio.run(run_turn(engine, [pick(r) for r in timed], params, ns.concurrency, mode))
        finally:
            restore()
        engine.flush_cache()
        results[mode] = state   # the second round's (the first warms what the warm-up did not)
        print(f"{mode}: {summary['output_tokens_per_s']:.0f} tok/s, {state['steps']} {ns.steps} steps, "
              f"{1e3 * state['seconds'] / max(1, state['steps']):.3f} ms a step (profiled)", flush=True)
    if ns.measure == "gaps":
        vocab = engine.core.runner.config.vocab_size
        print(json.dumps({"copy_ms": copy_ms(ns.concurrency, vocab), "rows": ns.concurrency, "vocab": vocab}))
        engine.shutdown()
        return
    per_step = {mode: {f: 1e3 * s / max(1, state["steps"]) for f, s in own_times(state["profile"]).items()}
                for mode, state in results.items()}
    grammar, free = per_step["grammar"], per_step["free"]
    print(f"\nown time a {ns.steps} step, grammar - free (ms):")
    for f in sorted(set(grammar) | set(free), key=lambda f: free.get(f, 0) - grammar.get(f, 0))[:30]:
        print(f"  {grammar.get(f, 0) - free.get(f, 0):+8.4f}  {grammar.get(f, 0):8.4f}  {f}")
    for mode, state in results.items():
        print(f"\n{mode}: top functions by cumulative time (whole run, {state['steps']} steps)")
        pstats.Stats(state["profile"]).sort_stats("cumulative").print_stats(25)
    engine.shutdown()


if __name__ == "__main__":
    main()
