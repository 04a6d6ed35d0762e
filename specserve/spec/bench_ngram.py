"""CPU cost of the n-gram trie drafter on a code workload: ``python -m specserve.spec.bench_ngram``.

Text is Python source from the standard library, split into words, punctuation and
whitespace runs (a stand-in for BPE ids: no tokenizer or model needed). Background
requests fill the shared trie first; then one request inserts a ~2000-token prompt and
decodes the next 200 tokens of the same file, drafting every step and committing what a
greedy verifier would accept against the true text (plus the bonus token). Last, the
whole corpus (~200k tokens) goes in at three capacities, to show the cost of eviction.
"""

from __future__ import annotations

import inspect
import re
import statistics
import time

from specserve.spec.ngram_trie import NgramConfig, NgramTrie

_SOURCES = ("argparse", "ast", "inspect", "typing", "dataclasses", "pathlib", "logging",
            "collections", "textwrap")


def _code_tokens() -> list[list[int]]:
    vocab: dict[str, int] = {}
    files = []
    for name in _SOURCES:
        text = inspect.getsource(__import__(name))
        pieces = re.findall(r"\w+|[^\w\s]|\s+", text)
        files.append([vocab.setdefault(piece, len(vocab)) for piece in pieces])
    return files


def _accepted(tokens: list[int], parents: list[int], truth: list[int]) -> int:
    """Tokens a greedy verifier accepts when the target's argmax is ``truth``."""
    accepted, node = 0, -1
    while accepted < len(truth):
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents))
                      if p == node and t == truth[accepted]), None)
        if child is None:
            break
        accepted, node = accepted + 1, child
    return accepted


def bench_propose(prompt_len: int = 2000, gen_len: int = 200, num_background: int = 8,
                  match_type: str = "BFS") -> list[dict]:
    files = _code_tokens()
    target, background = files[0], files[1:1 + num_background]
    rows = []
    for num_draft_tokens in (4, 8, 16):
        for one_branch in (True, False):
            trie = NgramTrie(NgramConfig(match_type=match_type))
            for owner, tokens in enumerate(background, start=1):
                trie.insert(tokens[:prompt_len + gen_len], owner=owner)
                trie.release(owner)
            prompt = target[:prompt_len]
            start = time.perf_counter_ns()
            trie.insert(prompt, owner=0)
            prompt_ns = (time.perf_counter_ns() - start) / len(prompt)
            history = list(prompt)
            propose_ns, insert_ns, steps = [], [], 0
            while len(history) < prompt_len + gen_len:
                start = time.perf_counter_ns()
                tokens, parents = trie.propose(history, num_draft_tokens, one_branch, owner=0)
                propose_ns.append(time.perf_counter_ns() - start)
                pos = len(history)
                commit = target[pos:pos + _accepted(tokens, parents, target[pos:]) + 1]
                start = time.perf_counter_ns()
                trie.insert(commit, owner=0)
                insert_ns.append((time.perf_counter_ns() - start) / len(commit))
                history += commit
                steps += 1
            rows.append({
                "match_type": match_type, "draft_tokens": num_draft_tokens,
                "one_branch": one_branch,
                "propose_us_mean": statistics.fmean(propose_ns) / 1e3,
                "propose_us_p50": statistics.median(propose_ns) / 1e3,
                "propose_us_max": max(propose_ns) / 1e3,
                "insert_us_per_token": statistics.fmean(insert_ns) / 1e3,
                "prompt_insert_us_per_token": prompt_ns / 1e3,
                "accept_length": (len(history) - prompt_len) / steps,
                "trie_nodes": trie.num_nodes(),
            })
    return rows


def bench_insert(capacity: int) -> float:
    """Microseconds per token to insert every background file, evicting when over capacity."""
    files = _code_tokens()
    trie = NgramTrie(NgramConfig(capacity=capacity))
    start = time.perf_counter_ns()
    for owner, tokens in enumerate(files, start=1):
        trie.insert(tokens, owner=owner)
        trie.release(owner)
    return (time.perf_counter_ns() - start) / sum(map(len, files)) / 1e3


def main() -> None:
    header = ("match  n_draft  one_branch  propose_us(mean/p50/max)  insert_us/tok  "
              "prompt_us/tok  accept_len  trie_nodes")
    print(header)
    for match_type in ("BFS", "PROB"):
        for row in bench_propose(match_type=match_type):
            print(f"{row['match_type']:5}  {row['draft_tokens']:7}  {row['one_branch']!s:10}  "
                  f"{row['propose_us_mean']:7.1f} /{row['propose_us_p50']:6.1f} /"
                  f"{row['propose_us_max']:6.1f}   {row['insert_us_per_token']:12.2f}  "
                  f"{row['prompt_insert_us_per_token']:13.2f}  {row['accept_length']:10.2f}  "
                  f"{row['trie_nodes']:10}")
    for capacity in (10_000_000, 1_000_000, 100_000):
        print(f"insert all {len(_SOURCES)} files, capacity {capacity:>10}: "
              f"{bench_insert(capacity):.2f} us/token")


if __name__ == "__main__":
    main()
