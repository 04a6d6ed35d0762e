"""Where a prefill under a grammar spends its extra host time (H200, 1.5B: ~2 ms a prefill
more than the same prompt without one). `python -m lab.grammar_prefill_phases [--model M]`
runs serial greedy requests (batch 1) with and without a regex (and with it through the
sampler's masked path, as prefills took it before Sampler.first_tokens), times the prefill step's
launch, read and commit and the sampler's prepare / sample, and prints one JSON line per
mode with each phase's median in ms, then the top host ops of one constrained prefill
(torch.profiler). Without --model: a tiny random llama with a small BPE vocabulary."""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict


def timed(phases, name, obj, attr):
    method = getattr(obj, attr)

    def run(*args, **kw):
        start = time.perf_counter()
        try:
            return method(*args, **kw)
        finally:
            phases[name].append((time.perf_counter() - start) * 1e3)
    setattr(obj, attr, run)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    ns = parser.parse_args()
    from specserve.engine.engine import Engine
    path = ns.model
    if path is None:
        from tests.spec_fixtures import make_tiny_directory
        path = tempfile.mkdtemp()
        make_tiny_directory(path, "llama", seed=5)
    engine = Engine(model_path=path, device=ns.device, dtype="bfloat16" if ns.device == "cuda" else "float32",
                    log_level="warning", max_total_tokens=65536)
    phases = defaultdict(list)
    from specserve.engine.prefill_step import PrefillStep
    for attr in ("launch", "read", "commit"):
        timed(phases, "prefill." + attr, PrefillStep, attr)
    from specserve.engine import core as core_module
    engine_class = type(engine.core)
    assert engine_class.__module__ == core_module.__name__
    timed(phases, "core._schedule", engine_class, "_schedule")
    timed(phases, "core.step", engine_class, "step")
    from specserve.sampling.sampler import Sampler
    for attr in ("prepare", "sample", "_grammar_bitmask"):
        timed(phases, "sampler." + attr, Sampler, attr)
    prompt = list(range(5, 205))
    modes = {"free": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True},
             "regex": {"temperature": 0, "max_new_tokens": 4, "regex": r"[a-z ]{4,40}"}}
    full_path = Sampler.first_tokens

    def masked_first_tokens(self, logits, reqs):   # the sampler's masked path, as before first_tokens kept to grammars
        import torch
        from specserve.verify.tree import DraftTrees
        trees = DraftTrees.root_only(torch.tensor([r.last_token for r in reqs]))
        return self.sample(logits, trees, reqs, self.prepare(trees, reqs))
    modes["regex-masked"] = modes["regex"]
    for mode, params in modes.items():
        Sampler.first_tokens = masked_first_tokens if mode == "regex-masked" else full_path
        for _ in range(5):
            engine.generate(input_ids=prompt, sampling_params=params)
        phases.clear()
        for i in range(ns.requests):
            engine.generate(input_ids=[7 + i % 50] + prompt, sampling_params=params)
        print(json.dumps({"mode": mode, **{k: round(statistics.median(v), 3) for k, v in sorted(phases.items())}}))
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(input_ids=[3] + prompt, sampling_params=modes["regex"])
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    engine.shutdown()


if __name__ == "__main__":
    main()
