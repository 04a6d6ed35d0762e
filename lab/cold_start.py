"""Cold start: how much slower is a fresh engine's first request of each shape than the
same request again?

`python -m lab.cold_start [--model M] [--device cuda] [--out FILE] [ServerArgs flags]`
starts one fresh engine per algorithm (plain, NGRAM), each in its own process (Triton keeps
compiled kernels per process: a second engine in the same one would start warm), and sends
it, one at a time, the shapes of a coding assistant's day: a short chat turn, two
code-editing prompts of ~400-600 tokens, and a prompt just under the prefill chunk size.
Each shape's first request is timed against the median of `--repeats` runs of the very
same request (greedy, `ignore_eos`, so the same tokens and steps; with NGRAM the drafter
is fresh before every run, so the drafts are the same too), with the engine's longest step
and the Triton kernels compiled during each.

One JSON line per measurement on stdout (and appended to `--out`): the engine's start (with
its warm-up), then per (algorithm, shape) `ratio` = first / repeat and the longest steps,
checked against the targets (GPU: first within 1.2x, no step over 50 ms; CPU: within 1.5x).
`--skip-server-warmup` shows the engine without its start-up warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator
from unittest import mock

from specserve.args import ServerArgs

ALGORITHMS = ("plain", "NGRAM")
SHAPES = ("short-chat", "code-edit-400", "code-edit-600", "long")
TARGETS = {"cuda": {"ratio": 1.2, "step_s": 0.05}, "cpu": {"ratio": 1.5, "step_s": None}}
CHAT_MESSAGE = "Write a haiku about the sea."
CODE_EDIT_TOKENS = (400, 600)
LONG_MARGIN = 64           # the long prompt stays this many tokens under the chunk size


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lab.cold_start", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES, help="in the order sent")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each request after its first")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="append the JSON lines to this file too")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)       # one engine, in this process
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)  # --model is --model-path (an alias, or else argparse's prefix match)
    if ns.repeats < 1 or ns.max_new_tokens < 1:
        parser.error("--repeats and --max-new-tokens must be >= 1")
    return ns


def main(argv=None) -> list[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_args(argv)
    if ns.child is not None:
        with open(ns.child_out, "a") as out:
            for row in run_engine(ns, ns.child):
                out.write(json.dumps(row) + "\n")
                out.flush()
        return []
    rows = []
    for algorithm in ns.algorithms:
        rows += _run_child(argv, algorithm)
    for row in rows:
        print(json.dumps(row), flush=True)
    if ns.out:
        with open(ns.out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    _print_table(rows)
    return rows


def _run_child(argv: list[str], algorithm: str) -> list[dict]:
    """One fresh engine in a fresh process; its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.jsonl")
        command = [sys.executable, "-m", "lab.cold_start", *argv, "--child", algorithm, "--child-out", path]
        result = subprocess.run(command)  # its logs go to our stderr
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    if result.returncode != 0:
        rows.append({"kind": "error", "algorithm": algorithm, "returncode": result.returncode})
    return rows


# --- one engine (the child process) ---
def run_engine(ns: argparse.Namespace, algorithm: str) -> Iterator[dict]:
    """Starts the engine, then measures each shape; rows as they come."""
    from specserve.bench.run_watch import RunWatch
    from specserve.engine import warmup
    from specserve.engine.engine import Engine

    args = ServerArgs.from_cli_args(ns).replace(speculative_algorithm=None if algorithm == "plain" else algorithm)
    reports = []
    real_warm_up = warmup.warm_up

    def recorded_warm_up(*a, **k):
        reports.append(real_warm_up(*a, **k))
        return reports[-1]

    start = time.perf_counter()
    with mock.patch.object(warmup, "warm_up", recorded_warm_up):
        engine = Engine(**vars(args))
    report = reports[0] if reports else None
    device = engine.core.runner.device.type
    yield {"kind": "engine_start", "algorithm": algorithm, "model": os.path.basename(engine.model_path),
           "device": device, "start_s": time.perf_counter() - start,
           "warmup_s": report.seconds if report else None, "warmup": report.summary() if report else None}
    watch = RunWatch(engine)
    try:
        shapes = request_shapes(engine)
        target = TARGETS["cuda" if device == "cuda" else "cpu"]
        for shape in ns.shapes:
            yield measure(engine, watch, algorithm, shape, shapes[shape], ns, target)
    finally:
        watch.close()
        engine.shutdown()


def request_shapes(engine) -> dict[str, list[int]]:
    """Token ids of each of SHAPES."""
    from specserve.bench.code_edit import code_edit_messages
    encode = lambda messages: engine.tokenizer(_as_prompt(engine, messages)).input_ids
    shapes = {"short-chat": encode([{"role": "user", "content": CHAT_MESSAGE}])}
    edits = [encode(m) for m in code_edit_messages(164)]
    for target in CODE_EDIT_TOKENS:
        shapes[f"code-edit-{target}"] = min(edits, key=lambda ids: abs(len(ids) - target))
    chunk = engine.core.runner.chunk_size
    shapes["long"] = _long_prompt(engine, min(chunk, engine.context_length // 2) - LONG_MARGIN)
    return shapes


def _long_prompt(engine, tokens: int) -> list[int]:
    """A code-editing request over as many functions as fit in `tokens` prompt tokens (the
    first one cut to that length if even it does not fit)."""
    from specserve.bench.code_edit import code_edit_messages
    bodies, ids = [], []
    for messages in code_edit_messages(164):
        candidate = _as_prompt(engine, [{"role": "user", "content": "\n\n".join(bodies + [messages[0]["content"]])}])
        candidate_ids = engine.tokenizer(candidate).input_ids
        if len(candidate_ids) > tokens:
            return ids or candidate_ids[:tokens]
        bodies.append(messages[0]["content"])
        ids = candidate_ids
    return ids


def _as_prompt(engine, messages: list[dict]) -> str:
    try:
        return engine.apply_chat_template(messages)
    except ValueError:  # no chat template: the raw text
        return "\n\n".join(m["content"] for m in messages)


def measure(engine, watch, algorithm: str, shape: str, ids: list[int], ns, target: dict) -> dict:
    """The first request of this shape, then `ns.repeats` more of the same."""
    params = {"temperature": 0.0, "max_new_tokens": ns.max_new_tokens, "ignore_eos": True}
    runs = [_timed(engine, watch, ids, params) for _ in range(1 + ns.repeats)]
    first, repeats = runs[0], runs[1:]
    repeat_s = statistics.median(r["seconds"] for r in repeats)
    repeat_step = max(r["longest_step_s"] for r in repeats)
    row = {"kind": "cold_start", "algorithm": algorithm, "shape": shape, "prompt_tokens": len(ids),
           "new_tokens": first["tokens"], "first_s": first["seconds"], "repeat_s": repeat_s,
           "ratio": first["seconds"] / repeat_s, "first_longest_step_s": first["longest_step_s"],
           "repeat_longest_step_s": repeat_step, "first_jit_compiles": first["jit_compiles"],
           "first_jit_compile_s": first["jit_compile_s"], "target_ratio": target["ratio"],
           "target_step_s": target["step_s"]}
    row["ok"] = row["ratio"] <= target["ratio"] and (
        target["step_s"] is None or max(first["longest_step_s"], repeat_step) <= target["step_s"])
    return row


def _timed(engine, watch, ids: list[int], params: dict) -> dict:
    from specserve.bench.gpu_suite import set_drafter
    args = engine.args
    if args.speculative is not None:  # the same (empty) trie for every run: the same drafts
        set_drafter(engine, args.speculative_num_draft_tokens, args.speculative_one_branch,
                    not args.speculative_disable_adaptive)
    watch.reset()
    start = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)
    return {"seconds": time.perf_counter() - start, "tokens": out["meta_info"]["completion_tokens"], **watch.summary()}


def _print_table(rows: list[dict]) -> None:
    lines = ["| algorithm | shape | prompt | first s | repeat s | ratio | longest step first / repeat ms | JIT | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "engine_start":
            warm = f"{r['warmup_s']:.1f} s warm-up" if r["warmup_s"] is not None else "no warm-up"
            lines.append(f"| {r['algorithm']} | engine start | | {r['start_s']:.1f} ({warm}) | | | | | |")
        elif r["kind"] == "cold_start":
            lines.append(f"| {r['algorithm']} | {r['shape']} | {r['prompt_tokens']} | {r['first_s']:.3f} | "
                         f"{r['repeat_s']:.3f} | {r['ratio']:.2f} | {1e3 * r['first_longest_step_s']:.0f} / "
                         f"{1e3 * r['repeat_longest_step_s']:.0f} | {r['first_jit_compiles']} | "
                         f"{'yes' if r['ok'] else 'NO'} |")
        else:
            lines.append(f"| {r['algorithm']} | failed (exit {r['returncode']}) | | | | | | | |")
    print("\n".join(lines), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
