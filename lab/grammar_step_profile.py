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
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time


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
        state, restore = profiled_steps(type(engine.core), ns.steps)
        try:
            summary = asyncio.run(run_turn(engine, [pick(r) for r in timed], params, ns.concurrency, mode))
        finally:
            restore()
        engine.flush_cache()
        results[mode] = state   # the second round's (the first warms what the warm-up did not)
        print(f"{mode}: {summary['output_tokens_per_s']:.0f} tok/s, {state['steps']} {ns.steps} steps, "
              f"{1e3 * state['seconds'] / max(1, state['steps']):.3f} ms a step (profiled)", flush=True)
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
