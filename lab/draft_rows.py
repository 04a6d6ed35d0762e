"""What NGRAM's drafting steps commit per request row at concurrency, and whether the drafter
saw every request's tokens in order: gpu_suite's cells of one workload (bench_cells: warm-up,
RunWatch, the policy trace) with two counters beside them, per turn (sharegpt-repeat has two).

A cell's accept length (output tokens per verify step) counts plain steps as steps of one
token, so it falls both when drafts get worse and when the adaptive policy decodes plainly
more. This splits the two: for every verified row that carried a draft, the draft tokens
and how many were accepted (`per_row`: accepted draft tokens per drafting row), and the
rows of drafting steps that had none. And at every proposal it checks that each request's
tokens handed to the drafter (its prompt, then what each step committed) are a prefix of
prompt + output in order (`diverged`: a proposal where they are not), and how many tokens
each proposal's request had that were not handed over yet (`missing`: ~1 step's tokens is
what the design allows).

On a CPU it forces what a GPU engine has on (the overlap schedule, drafting steps launched
ahead): `python -m lab.draft_rows --concurrency 8 --num-prompts 16 --max-new-tokens 64`
(SmolLM2, ~1 min a cell); `--workload sharegpt-repeat` prints a row per turn (turn 2: the same
requests again, the trie holding turn 1's answers), and `--dump F.jsonl` keeps each turn's counters and
outputs, to compare two trees run alike. On a GPU: `--device cuda --dtype bfloat16 --model-path M.gguf`.
`--price MS` prices the adaptive policy's steps at a 10-ms plain step plus MS a verified
node a request (tests/spec_fixtures.price_steps' model), the CPU's timings out of it.
"""
from __future__ import annotations

import argparse
import collections
import json
import types

from specserve.bench import gpu_suite, offline
from specserve.runner import tree_step


class DraftRows:
    """Counts each greedy verify step's rows: drafting rows' draft and accepted tokens. A
    step's trees are recorded when it is launched and matched with its outcome when it is
    parsed (launches and reads alternate: a step launched ahead is read before the next)."""

    def __init__(self, runner):
        self.counts: collections.Counter = collections.Counter()
        self._launched: list = []
        run_trees, parse = runner.run_trees, tree_step.GreedyOutcome.parse.__func__

        def counted_run_trees(reqs, proposal, *args, **kwargs):
            if proposal.num_slots > 1:
                self._launched.append(proposal.num_nodes.copy())
            return run_trees(reqs, proposal, *args, **kwargs)

        def counted_parse(cls, packed):
            outcome = parse(cls, packed)
            if self._launched:
                self._count(self._launched.pop(0), outcome.accept_lens)
            return outcome
        runner.run_trees = counted_run_trees
        tree_step.GreedyOutcome.parse = classmethod(counted_parse)

    def _count(self, num_nodes, accept_lens) -> None:
        counts = self.counts
        if len(num_nodes) != len(accept_lens):   # rows cut between launch and read
            counts["unmatched_steps"] += 1
            return
        for nodes, accepted in zip(num_nodes.tolist(), accept_lens.tolist()):
            if nodes > 1:
                counts["rows"] += 1
                counts["drafted"] += nodes - 1
                counts["accepted"] += accepted - 1
            else:
                counts["rows_without_draft"] += 1


def watch_streams(drafter, counts: collections.Counter) -> None:
    """Checks, at every proposal, each request's tokens handed to the drafter against its
    prompt + output (instance attributes over the drafter's methods)."""
    fed: dict[str, list[int]] = collections.defaultdict(list)
    add_prompt, observe_batch, propose = drafter.add_prompt, drafter.observe_batch, drafter.propose

    def watched_add_prompt(req):
        fed[req.rid].extend(req.prompt_ids)
        return add_prompt(req)

    def watched_observe_batch(reqs, committed):
        for req, tokens in zip(reqs, committed):
            fed[req.rid].extend(tokens)
        return observe_batch(reqs, committed)

    def watched_propose(reqs, limits):
        for req in reqs:
            full, got = req.prompt_ids + req.output_ids, fed[req.rid]
            counts["proposals"] += 1
            counts["diverged"] += got != full[:len(got)]
            counts["missing"] += len(full) - len(got)
        return propose(reqs, limits)
    drafter.add_prompt, drafter.observe_batch, drafter.propose = \
        watched_add_prompt, watched_observe_batch, watched_propose


def priced(policy, plain_ms: float, node_ms: float) -> None:
    record = policy.record_step

    def record_priced(batch_size, tree_size, seconds, tokens=None, steady=True, nodes=None, prefill=False):
        per_request = nodes / batch_size if nodes is not None and tree_size > 1 else tree_size
        record(batch_size, tree_size, (plain_ms + node_ms * (per_request - 1)) / 1e3, tokens, steady, nodes, prefill)
    policy.record_step = record_priced


def watch_turns(counts: collections.Counter, streams: collections.Counter) -> list:
    """Splits the counters by turn (a sharegpt-repeat run has two): every timed or warm-up turn
    starts them from zero and leaves (counts, streams, output tokens) in the list returned; a run
    clears the list first, so after a cell's timed run it holds that run's turns."""
    turns: list = []
    run_turn, summarize, run = gpu_suite.run_turn, offline.summarize, gpu_suite.run
    outputs: list = []

    async def counted_run_turn(*args, **kwargs):
        counts.clear()
        streams.clear()
        summary = await run_turn(*args, **kwargs)
        turns.append((collections.Counter(counts), collections.Counter(streams), list(outputs)))
        return summary

    def kept_summarize(results, *args, **kwargs):
        outputs[:] = [out["output_ids"] for out in results]
        return summarize(results, *args, **kwargs)

    def cleared_run(*args, **kwargs):
        turns.clear()
        return run(*args, **kwargs)
    gpu_suite.run_turn, offline.summarize, gpu_suite.run = counted_run_turn, kept_summarize, cleared_run
    return turns


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="default: SmolLM2-135M's GGUF")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--workload", choices=("code-types", "code-rename", "sharegpt-repeat"), default="code-types",
                        help="sharegpt-repeat runs two turns (the same requests again): a row per turn")
    parser.add_argument("--configs", nargs="+", default=["default"], help="gpu_suite labels, or 'default'")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--price", type=float, default=None, metavar="MS")
    parser.add_argument("--dump", default=None, metavar="JSONL",
                        help="per turn: the counters and every request's output tokens (to compare two trees)")
    ns = parser.parse_args(argv)
    from specserve.engine.draft_ahead import DraftAhead
    from specserve.engine.engine import Engine
    from specserve.engine.overlap import OverlapSchedule
    from specserve.model.loader import default_model_path
    engine = Engine(model_path=ns.model_path or default_model_path(), speculative_algorithm="NGRAM",
                    speculative_num_draft_tokens=16, log_level="warning", dtype=ns.dtype, device=ns.device)
    core = engine.core
    if core.overlap is None:   # CUDA-graph-only by default: what a GPU engine runs
        core.overlap, core.draft_ahead = OverlapSchedule(core.runner, core.scheduler, core.sampler), DraftAhead(core.scheduler)
    rows, streams = DraftRows(core.runner), collections.Counter()
    set_drafter = gpu_suite.set_drafter

    def watched_set_drafter(engine, *spec):
        set_drafter(engine, *spec)
        if core.drafter is not None:
            watch_streams(core.drafter, streams)
            if core.adaptive is not None and ns.price is not None:
                priced(core.adaptive, 10.0, ns.price)
    gpu_suite.set_drafter = watched_set_drafter
    turns = watch_turns(rows.counts, streams)

    def write(row: dict) -> None:
        if row.get("kind") != "specserve":
            return
        counts, seen, outputs = turns.pop(0)
        mix = {kind: (m["steps"], m["mean_batch"]) for kind, m in row["step_mix"].items()}
        per_row = counts["accepted"] / counts["rows"] if counts["rows"] else None
        print(f"{row['workload']} c{row['concurrency']} {row['config']} r{row['round']} t{row.get('turn', 1)}: "
              f"accept {row.get('accept_length') or 0:.2f}, {row['output_tokens_per_s']:.0f} tok/s, "
              f"{row['output_tokens']} tokens, steps (count, batch) {mix}; drafting rows {dict(counts)}, "
              f"accepted per drafting row {per_row if per_row is None else round(per_row, 2)}; streams {dict(seen)}",
              flush=True)
        if dump is not None:
            dump.write(json.dumps({"workload": row["workload"], "concurrency": row["concurrency"],
                                   "config": row["config"], "round": row["round"], "turn": row.get("turn", 1),
                                   "counts": dict(counts), "streams": dict(seen), "outputs": outputs}) + "\n")
            dump.flush()   # a run cut short keeps its cells
    ns.workloads, ns.dataset_path = [ns.workload], None
    workloads = {ns.workload: gpu_suite.suite_workloads(engine, ns)[ns.workload]}
    cells = types.SimpleNamespace(concurrency=ns.concurrency, num_prompts=ns.num_prompts, bs1_prompts=4,
                                  configs=ns.configs, rounds=ns.rounds, max_new_tokens=ns.max_new_tokens, repeats=1,
                                  policy_trace_dir=None)
    dump = open(ns.dump, "w") if ns.dump else None
    try:
        gpu_suite.bench_cells(engine, cells, "model", workloads, 1.0, write)
    finally:
        engine.shutdown()
        if dump is not None:
            dump.close()


if __name__ == "__main__":
    main()
