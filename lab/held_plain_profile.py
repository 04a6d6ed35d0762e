"""Where an EAGLE engine held plain loses to the plain engine at concurrency 32-64 (issue 56's
>= 1.0x cells): each mode's timed run of ShareGPT second turns, then the same prompts again
with the drafter's parts timed (its feeds, probes, the states it keeps after each step,
the release of finished requests), then once more under torch.profiler for the kernels.

    python -m lab.held_plain_profile --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \\
        --draft /root/eagle3-1.5b --dataset-path .gpu/sharegpt_bench.json --out $OUT/profile

Modes as bench.model_drafters has them: plain (the drafter set aside), held (never drafts nor
probes, still fed), adaptive (the default) and pinned. With `--modes plain pinned` it says where
a drafting engine's steps that admit new requests go: the first drafts' catch-up over the
prompt (EagleDrafter._catch_up, or `prefilled`, in the prefill's step), their chain (EagleHeadRunner.draft) and the rest of
FusedChainDrafter._first_drafts, its one host sync included. Rows to held_plain_profile.jsonl: per mode the
unprofiled tok/s, the timed parts (calls, host ms, GPU ms between events around each), and
the profiled run's GPU busy time against the wall, with the kernels by GPU time.

`--hybrid` profiles the hybrid of the head and the n-gram trie instead, its own parts timed too (the
trie's lookups, the choice, its bookkeeping), beside each drafting step's launch (a graph's replay or
the eager function) and commit: where, at 64 on an H100, its head steps took ~7.4 ms against EAGLE-3's
~4.2 (BENCHMARKS.md). On this project's CPU (tiny random target and head, batch 64, every step a head
step) its commits took 1.83 ms a step against EAGLE-3's 1.05: the trie's lookups for the counterfactual
held in each commit (0.38 ms) and its observe_batch (0.34 ms), not enough to explain the GPU's gap.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import time

import torch

from specserve.bench.gpu_suite import run, suite_workloads
from specserve.bench.model_drafters import Config, fresh_drafter, make_engine, set_mode
from specserve.bench.result_rows import emit_row

# (module, class, method) marked in the profile: what a drafting engine does beside a plain one's step
MARKED = [("specserve.speculative.model_drafters.eagle", "EagleDrafter", "feed"),
          ("specserve.speculative.model_drafters.eagle", "EagleDrafter", "observe_hidden"),
          ("specserve.speculative.model_drafters.eagle", "EagleDrafter", "observe_batch"),
          ("specserve.speculative.model_drafters.eagle", "EagleDrafter", "propose"),
          ("specserve.speculative.model_drafters.eagle", "EagleDrafter", "_catch_up"),
          ("specserve.speculative.model_drafters.eagle", "EagleDrafter", "prefilled"),
          ("specserve.engine.prefill_step", "PrefillStep", "launch"),
          ("specserve.speculative.model_drafters.eagle_runner", "EagleHeadRunner", "draft"),
          ("specserve.speculative.model_drafters.fused_drafter", "FusedChainDrafter", "_first_drafts"),
          ("specserve.speculative.model_drafters.fused_drafter", "FusedChainDrafter", "propose"),
          ("specserve.engine.draft_planner", "DraftPlanner", "probe"),
          ("specserve.kv.ledger", "KVLedger", "cache_prefill"),
          ("specserve.engine.scheduler", "Scheduler", "schedule"),
          ("specserve.kv.ledger", "KVLedger", "before_release"),
          ("specserve.kv.ledger", "KVLedger", "release"),
          # a drafting step's launch (a graph's replay, or the same function eagerly: a batch past the graphs)
          # and its commit, the next step's proposal held in it
          ("specserve.speculative.model_drafters.fused_chain", "FusedGraphs", "replay"),
          ("specserve.speculative.model_drafters.fused_chain", "FusedGraphs", "replay_chained"),
          ("specserve.speculative.model_drafters.fused_chain", "FusedChainRunner", "_run_eagerly"),
          ("specserve.engine.drafting_step", "DraftingStep", "commit"),
          ("specserve.engine.drafting_step", "DraftingStep", "_hold_chained")]
# --hybrid: what the hybrid adds to the head's steps (the trie's lookups, the choice, its bookkeeping)
HYBRID_MARKED = [("specserve.speculative.hybrid.fused_hybrid", "FusedHybridDrafter", "chained_proposal"),
                 ("specserve.speculative.hybrid.drafter", "HybridDrafter", "propose"),
                 ("specserve.speculative.hybrid.drafter", "HybridDrafter", "observe_batch"),
                 ("specserve.speculative.ngram.drafter", "NgramDrafter", "propose"),
                 ("specserve.speculative.hybrid.source_choice", "SourceChoice", "choose"),
                 ("specserve.speculative.hybrid.source_choice", "SourceChoice", "breaks_chain")]


class PartTimes:
    """Per marked part: calls, host seconds, and GPU milliseconds between CUDA events recorded
    around it on the current stream (the kernels it queued, plus any gap while the host
    launched them). The engine runs in its own thread, where torch.profiler records no
    host events, so the parts are timed here."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.calls, self.host = collections.Counter(), collections.Counter()
        self.events: dict[str, list] = collections.defaultdict(list)

    def timed(self, fn, name: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.cuda:
                    end.record()
                    self.events[name].append((begin, end))
                self.calls[name] += 1
                self.host[name] += time.perf_counter() - start
        return wrapper

    def summary(self) -> dict:
        if self.cuda:
            torch.cuda.synchronize()
        return {name: {"calls": self.calls[name], "host_ms": self.host[name] * 1e3,
                       "gpu_ms": sum(b.elapsed_time(e) for b, e in self.events[name]) if self.cuda else None}
                for name in self.calls}


@contextlib.contextmanager
def marked_methods(times: PartTimes, marked: list[tuple[str, str, str]] = MARKED):
    """Each `marked` method timed into `times` while the block runs."""
    import importlib
    originals = []
    for module_name, class_name, method in marked:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = cls.__dict__[method]
        originals.append((cls, method, original))
        setattr(cls, method, times.timed(original, f"{class_name}.{method}"))
    try:
        yield
    finally:
        for cls, method, original in originals:
            setattr(cls, method, original)


def kernel_summary(prof, wall_s: float, top: int) -> dict:
    """The GPU's busy time (kernels' sum) against the wall, and the top kernels."""
    kernels, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total
            counts[event.name] += 1
    return {"wall_ms": wall_s * 1e3, "gpu_busy_ms": sum(kernels.values()) / 1e3,
            "kernels": [{"name": name[:120], "calls": counts[name], "gpu_ms": us / 1e3}
                        for name, us in kernels.most_common(top)]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="/root/models/qwen2.5-coder-1.5b-instruct.gguf")
    parser.add_argument("--draft", default="/root/eagle3-1.5b")
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--modes", nargs="+", default=["plain", "held", "adaptive"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="unprofiled timed runs per mode, in turn")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="without the prefix cache (which keeps an EAGLE prompt from its prefill on)")
    parser.add_argument("--hybrid", action="store_true",
                        help="the hybrid of the head and the n-gram trie (--speculative-hybrid-ngram, forecast 2), its "
                             "own parts timed too: where its drafting steps at 64 cost more than EAGLE-3's alone")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ns = parser.parse_args(argv)
    ns.workloads, ns.mem_fraction_static = ["sharegpt-multiturn"], 0.8
    ns.num_draft_tokens = 8
    os.makedirs(ns.out, exist_ok=True)
    write = functools.partial(emit_row, os.path.join(ns.out, "held_plain_profile.jsonl"))

    engine = make_engine(ns, Config("EAGLE3", num_steps=3, hybrid=ns.hybrid, forecast=2 if ns.hybrid else None))
    marked = MARKED + HYBRID_MARKED if ns.hybrid else MARKED
    drafter = engine.core.drafter
    prompts, warm_prompts = suite_workloads(engine, ns)["sharegpt-multiturn"]
    try:
        for concurrency in ns.concurrency:
            count = min(ns.num_prompts, 2 * concurrency)
            for round_ in range(ns.rounds):
                for mode in ns.modes:
                    drafter = fresh_drafter(drafter)
                    set_mode(engine, drafter, mode)
                    run(engine, warm_prompts[:count], concurrency, ns.max_new_tokens // 2, f"warm-up {mode}")
                    summary = run(engine, prompts[:count], concurrency, ns.max_new_tokens, mode)[0]
                    write({"kind": "timed", "hybrid": ns.hybrid, "mode": mode, "concurrency": concurrency, "round": round_,
                           "tok_s": summary["output_tokens_per_s"], "duration_s": summary["duration_s"],
                           "accept_length": summary.get("accept_length")})
            for mode in ns.modes:
                drafter = fresh_drafter(drafter)
                set_mode(engine, drafter, mode)
                run(engine, warm_prompts[:count], concurrency, ns.max_new_tokens // 2, f"warm-up {mode}")
                times = PartTimes(ns.device == "cuda")
                with marked_methods(times, marked):   # the parts timed, unprofiled
                    summary = run(engine, prompts[:count], concurrency, ns.max_new_tokens, mode)[0]
                write({"kind": "parts", "hybrid": ns.hybrid, "mode": mode, "concurrency": concurrency,
                       "tok_s": summary["output_tokens_per_s"], "parts": times.summary()})
                activities = [torch.profiler.ProfilerActivity.CPU] + \
                    ([torch.profiler.ProfilerActivity.CUDA] if ns.device == "cuda" else [])
                with torch.profiler.profile(activities=activities) as prof:
                    start = time.perf_counter()
                    run(engine, prompts[:count], concurrency, ns.max_new_tokens, mode)
                    wall = time.perf_counter() - start
                write({"kind": "kernels", "hybrid": ns.hybrid, "mode": mode, "concurrency": concurrency,
                       **kernel_summary(prof, wall, ns.top)})
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
