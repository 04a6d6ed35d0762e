"""Host time of a constrained plain decode step's grammar work, phase by phase, on the
schema-extraction workload with a real vocabulary (Qwen2.5's 151k, from the GGUF file).

On the overlap schedule (engine/overlap.py) a constrained greedy step is launched on the
previous step's unmasked argmax, no mask filled before it; as the step is read, each request's
token is checked by its matcher and taken ahead (`check`: grammar/next_masks.py, an accept a
row), then the commit confirms it (`commit`: grammar_finish). Only a token the grammar forbids
costs a mask fill and a read of the step's logits (and its row of the step ahead): these
replays follow their grammars, so they time the steps without a stray, which is every step
where the model writes what its grammar allows. Requests replay their right answers
(bench/extraction.py's records as JSON, tokenized by the model's tokenizer, then its stop
token), `--batch-size` of them at a time, a finished one replaced by the next, so the matchers
pass through the states a real run's do, without a model.

`python -m lab.grammar_step_host --batch-sizes 1 64 [--requests 128] [--indent 2] [--repeats 3]`
prints one JSON line per batch size: ms a step per phase, wall and the process's CPU time
(every thread's), means over the steps of the fastest repeat (a shared CPU's other loads only
add), steps, mean rows, and the mean wall total over the steps of a full batch (before the
last requests drain: a server's steady state); `--model-path` (default
models/qwen2.5-coder-1.5b-instruct.gguf).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.grammar.finish import grammar_finish
from specserve.grammar.next_masks import keep_plain_to_grammar

DEFAULT_MODEL = "models/qwen2.5-coder-1.5b-instruct.gguf"
PHASES = ("check", "commit")


@dataclass
class Row:
    """One replayed request: its matcher and the tokens of its answer."""
    rid: str
    grammar: object
    tokens: list[int]
    done: int = 0    # tokens committed


def load_vocabulary(path: str):
    """(tokenizer, vocab size, stop token ids) of a GGUF model, by the project's loader."""
    from specserve.model.config import ModelConfig
    from specserve.model.gguf_file import GGUFFile
    from specserve.model.loader import _load_gguf_tokenizer
    gguf = GGUFFile(path)
    config = ModelConfig.from_gguf(gguf.metadata, vocab_size=int(gguf.tensors["token_embd.weight"].shape[-1]),
                                   has_output_weight="output.weight" in gguf.tensors)
    return _load_gguf_tokenizer(path, gguf.metadata), config.vocab_size, list(config.eos_token_ids)


def answers(tokenizer, stop: int, count: int, indent: int | None) -> list[tuple[str, list[int]]]:
    """(schema text, answer tokens ending with the stop token) of `count` extraction requests."""
    from specserve.bench.extraction import extraction_records
    return [(json.dumps(request.json_schema), tokenizer(json.dumps(answer, indent=indent)).input_ids + [stop])
            for request, answer in extraction_records(count, seed=1)]


def _clock() -> np.ndarray:
    return np.array([time.perf_counter(), time.process_time()])


class Replay:
    """`batch_size` rows at a time over the answers; each step's phases timed."""

    def __init__(self, grammars, answers: list[tuple[str, list[int]]], batch_size: int, vocab_size: int):
        from specserve.request.grammar_spec import GrammarSpec
        self.pending = [Row(str(i), grammars.matcher(GrammarSpec("json_schema", schema)), tokens)
                        for i, (schema, tokens) in enumerate(answers)]
        self.pending.reverse()
        self.rows: list[Row] = []
        self.batch_size = batch_size
        self.logits = torch.empty((batch_size, vocab_size))   # read only where a grammar forbids a token: never here
        self.seconds = {phase: [] for phase in PHASES}       # wall
        self.cpu_seconds = {phase: [] for phase in PHASES}   # the process's CPU, every thread's
        self.live_rows: list[int] = []

    def run(self) -> None:
        self._refill()
        while self.rows:
            self.step()

    def step(self) -> None:
        rows = self.rows
        tokens = [row.tokens[row.done] for row in rows]
        clocks = [_clock()]
        assert not keep_plain_to_grammar([row.grammar for row in rows], tokens, lambda picked: self.logits[picked])
        clocks.append(_clock())
        ended = [grammar_finish(row, token, None) is not None for row, token in zip(rows, tokens)]
        clocks.append(_clock())
        for phase, span in zip(PHASES, (clocks[1] - clocks[0], clocks[2] - clocks[1])):
            self.seconds[phase].append(span[0])
            self.cpu_seconds[phase].append(span[1])
        self.live_rows.append(len(rows))
        for row in rows:
            row.done += 1
        self.rows = [row for row, end in zip(rows, ended) if not end]
        self._refill()

    def _refill(self) -> None:
        while len(self.rows) < self.batch_size and self.pending:
            self.rows.append(self.pending.pop())


def main(argv=None) -> None:
    from specserve.grammar.compiler import GrammarCache
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, default=None, help="default: gpu_suite's, 2x the batch, 16 or more")
    parser.add_argument("--indent", type=int, default=None, help="the answers' JSON indent (default: one line)")
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args(argv)
    tokenizer, vocab_size, stops = load_vocabulary(ns.model_path)
    grammars = GrammarCache(tokenizer, vocab_size, stops)
    for batch_size in ns.batch_sizes:
        count = ns.requests or max(2 * batch_size, 16)
        replies = answers(tokenizer, stops[0], count, ns.indent)
        Replay(grammars, replies[:batch_size], batch_size, vocab_size).run()   # warm-up, compiles
        repeats = []
        for _ in range(ns.repeats):
            replay = Replay(grammars, replies, batch_size, vocab_size)
            replay.run()
            repeats.append(replay)
        totals = [sum(map(sum, r.seconds.values())) / len(r.live_rows) for r in repeats]
        best = repeats[totals.index(min(totals))]
        full = [i for i, rows in enumerate(best.live_rows) if rows == batch_size]   # before the last ones drain
        print(json.dumps({"batch_size": batch_size, "requests": count, "steps": len(best.live_rows),
                          "mean_rows": round(statistics.mean(best.live_rows), 1),
                          **{f"{phase}_ms": round(1e3 * statistics.mean(best.seconds[phase]), 3) for phase in PHASES},
                          **{f"{phase}_cpu_ms": round(1e3 * statistics.mean(best.cpu_seconds[phase]), 3)
                             for phase in PHASES},
                          "total_ms": round(1e3 * min(totals), 3),
                          "full_batch_steps": len(full), "full_batch_total_ms": round(1e3 * statistics.mean(
                              sum(best.seconds[phase][i] for phase in PHASES) for i in full), 3)}))


if __name__ == "__main__":
    main()
