"""Do NGRAM drafts made before a step's outcome is read commit as much as drafts made after?

Without forecasts an NGRAM verify step N + 1 is proposed once N's outcome is on the host: the
read, the commit, the trie's proposal and the launch lie between two steps on the GPU
(0.15-0.45 ms at batch 1 on an H200). With `--speculative-ngram-forecast` it is launched
before N is read, its drafts chosen on the device from the trie's forecast made while N ran
(speculative/ngram/forecast.py, which this replay calls): for each accept length a of N's
chain, the trie's likeliest next tokens after the context and N's first a drafts (not the
rejected draft where a is short of the chain), each with the chain the trie continues it
with. N's outcome (a, bonus token) picks the entry; none, no drafts (the step then commits
one token at a verify's cost).

This replays greedy decoding without a model, as `lab.draft_step_host` does (each workload's
answer is the text a good model writes), twice over the same answers with a trie each:
proposals after the read (`after`), and forecasts (`forecast`), every step a chain of at most
--draft-tokens drafts. Per workload: tokens a step, forecast hits, the forecast's trie calls
and host time a step, and a modelled rate against plain decoding from the step costs given
(StepCosts: a drafting step at verify cost, plus the exposed host time for `after`; a step
with nothing to draft at plain cost):

    python -m lab.ngram_forecast --model-path SmolLM2-135M-Instruct.Q4_1.gguf --requests 16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

from lab.draft_step_workloads import code_edit_streams
from lab.plain_step_host import sharegpt_streams
from specserve.args import ServerArgs
from specserve.speculative.ngram.drafter import NgramDrafter
from specserve.runner.forecast_step import NO_ENTRY
from specserve.speculative.ngram.trie import NgramTrie
from specserve.verify.tree import TreeProposal


@dataclass
class Replay:
    steps: int = 0
    tokens: int = 0
    drafted: int = 0            # steps that verified at least one draft
    forecast_rows: int = 0      # rows of the forecast tables made
    forecast_hits: int = 0      # steps whose outcome found a row
    forecast_calls: int = 0     # trie calls the forecasts made (one a step: trie.c's ngt_forecast)
    forecast_s: list[float] = field(default_factory=list)
    modelled_ms: float = 0.0    # the steps' time under StepCosts


@dataclass(frozen=True)
class StepCosts:
    plain_ms: float     # a plain step, launched ahead: no host time between steps
    verify_ms: float    # a verify step of the chain's size
    host_ms: float      # what a proposal after the read leaves between two steps

    def step_ms(self, drafts: bool, launched_ahead: bool) -> float:
        if not drafts:
            return self.plain_ms
        return self.verify_ms + (0.0 if launched_ahead else self.host_ms)


def accepted(drafts: list[int], answer: list[int], pos: int) -> int:
    """How many of the chain's drafts a greedy verifier accepts against the answer at pos."""
    count = 0
    for token in drafts:
        if pos + count >= len(answer) or answer[pos + count] != token:
            break
        count += 1
    return count


def chain(trie: NgramTrie, context: list[int], draft_tokens: int, owner: int) -> list[int]:
    return trie.propose(context, draft_tokens + 1, one_branch=True, owner=owner)[0]


def forecast(trie: NgramTrie, context: list[int], drafts: list[int], draft_tokens: int, candidates: int,
             owner: int, replay: Replay) -> dict[tuple[int, int], list[int]]:
    """(accept length, first token) -> the drafts after that token, for every accept length of
    the chain `drafts` and the candidates the engine's forecast (speculative/ngram/forecast.py)
    gives there."""
    start = time.perf_counter()
    chain_tree = TreeProposal.from_lists([([context[-1]] + drafts, list(range(-1, len(drafts))))])
    table = trie.forecast([context[-16:]], [owner], chain_tree, draft_tokens + 1, candidates, True, 6)
    replay.forecast_calls += 1
    forecasts = {}
    n = draft_tokens + 1
    for a in range(len(drafts) + 1):
        for entry in table[0, a]:
            if entry[0] != NO_ENTRY:
                forecasts[a, int(entry[0])] = entry[1:int(entry[2 * n - 1])].tolist()
    replay.forecast_rows += len(forecasts)
    replay.forecast_s.append(time.perf_counter() - start)
    return forecasts


def replay(prompts, answers, draft_tokens: int, candidates: int, ahead: bool, costs: StepCosts) -> Replay:
    """Greedy decoding of every answer with one trie (requests one after another). A step
    with nothing to verify is a plain one; ahead, a step launched from a forecast table with
    any row verifies a full chain whatever its outcome picks (the host chose its size)."""
    trie = NgramTrie(NgramDrafter.from_args(ServerArgs()).config)
    result = Replay()
    for owner, (prompt, answer) in enumerate(zip(prompts, answers)):
        trie.insert(prompt, owner)
        context, pos = list(prompt), 0
        drafts = chain(trie, context, draft_tokens, owner)
        verifies, launched_ahead = bool(drafts), False   # the first step: proposed after its prefill
        while pos < len(answer):
            result.modelled_ms += costs.step_ms(verifies, launched_ahead)
            table = forecast(trie, context, drafts, draft_tokens, candidates, owner, result) if ahead else None
            a = accepted(drafts, answer, pos)
            committed = answer[pos:pos + a + 1]
            trie.insert(committed, owner)
            context += committed
            pos += len(committed)
            result.steps += 1
            result.tokens += len(committed)
            result.drafted += bool(drafts)
            if table is None:
                drafts = chain(trie, context, draft_tokens, owner)
                verifies = bool(drafts)
            else:
                drafts = table.get((a, committed[-1]), [])
                result.forecast_hits += (a, committed[-1]) in table
                verifies, launched_ahead = bool(table), True
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="its tokenizer and chat template make the prompts")
    parser.add_argument("--workloads", nargs="+", default=["code-types", "code-rename", "sharegpt"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--min-output", type=int, default=200)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--candidates", type=int, default=2, help="first tokens forecast per accept length")
    parser.add_argument("--plain-ms", type=float, default=1.25, help="a plain step (1.5B, batch 1, H200)")
    parser.add_argument("--verify-ms", type=float, default=1.50, help="a verify step of the chain's size")
    parser.add_argument("--host-ms", type=float, default=0.30, help="host time exposed by a proposal after the read")
    ns = parser.parse_args(argv)
    from specserve.engine.engine import Engine
    engine = Engine(model_path=ns.model_path, device="cpu", log_level="warning", skip_server_warmup=True)
    engine.shutdown()
    for workload in ns.workloads:
        if workload == "sharegpt":
            prompts, answers = sharegpt_streams(engine, ns.requests, ns.min_output)
        else:
            prompts, answers = code_edit_streams(engine.tokenizer, engine.apply_chat_template, ns.requests,
                                                 workload.removeprefix("code-"), ns.min_output)
        costs = StepCosts(ns.plain_ms, ns.verify_ms, ns.host_ms)
        for k in ns.draft_tokens:
            after = replay(prompts, answers, k, ns.candidates, False, costs)
            ahead = replay(prompts, answers, k, ns.candidates, True, costs)
            print(json.dumps({
                "workload": workload, "draft_tokens": k, "candidates": ns.candidates,
                "after_tokens_per_step": round(after.tokens / after.steps, 3),
                "forecast_tokens_per_step": round(ahead.tokens / ahead.steps, 3),
                "after_drafted_share": round(after.drafted / after.steps, 3),
                "forecast_hit_share": round(ahead.forecast_hits / ahead.steps, 3),
                "forecast_rows_per_step": round(ahead.forecast_rows / ahead.steps, 2),
                "forecast_trie_calls_per_step": round(ahead.forecast_calls / ahead.steps, 2),
                "forecast_host_us_median": round(statistics.median(ahead.forecast_s) * 1e6, 1),
                "after_vs_plain": round(after.tokens * ns.plain_ms / after.modelled_ms, 3),
                "forecast_vs_plain": round(ahead.tokens * ns.plain_ms / ahead.modelled_ms, 3)}),
                flush=True)


if __name__ == "__main__":
    main()
