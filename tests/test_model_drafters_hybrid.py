"""bench.model_drafters with --hybrid-modes and --ngram-default: one call times plain, the
EAGLE-3 head, the hybrid of that head and the n-gram trie (its rows with their proposals by
source) and the NGRAM engine of default flags, on the same prompts; and a drafter that keeps a
trie starts each cell with an empty one. Tiny random target and head on the CPU; the suite's
workloads replaced by token prompts (the tiny tokenizer has no chat template)."""
from __future__ import annotations

import json

import pytest

from specserve.bench import model_drafters
from specserve.speculative.ngram.drafter import NgramDrafter
from specserve.speculative.ngram.trie import NgramConfig
from specserve.speculative.ngram.writer import TrieWriterError
# unpriced_steps: autouse here too (the rows' sources would move with the CPU's wall times)
from tests.test_hybrid_drafting import PROMPTS, REPEATING, models, unpriced_steps  # noqa: F401

WARM = [[40, 41, 42, 43] * 4, [7, 8] * 8, list(range(80, 100)), [60, 61, 62] * 5]
HYBRID_LABELS = {"eagle3-3-hybrid-pinned", "eagle3-3-hybrid-adaptive"}


def test_one_call_gives_plain_ngram_eagle_and_hybrid_rows(models, tmp_path, monkeypatch):  # noqa: F811
    target, head = models
    workloads = {"code-types": (PROMPTS + [REPEATING[2:]], WARM), "sharegpt-multiturn": (PROMPTS[::-1], WARM)}
    monkeypatch.setattr(model_drafters, "suite_workloads", lambda engine, ns: workloads)
    monkeypatch.setattr(model_drafters, "measure_copy_bandwidth", lambda device: 1e9)
    model_drafters.main(["--target", str(target), "--draft", str(head), "--algorithm", "EAGLE3", "--num-steps", "3",
                         "--device", "cpu", "--dtype", "float32", "--workloads", "code-types", "sharegpt-multiturn",
                         "--concurrency", "1", "4", "--num-prompts", "4", "--bs1-prompts", "2",
                         "--max-new-tokens", "24", "--hybrid-modes", "pinned", "adaptive", "--ngram-default",
                         "--policy-trace-dir", str(tmp_path / "traces"), "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "model_drafters.jsonl").read_text().splitlines()]
    assert [r["config"] for r in rows if r["kind"] == "engine"] == ["eagle3-3", "eagle3-3-hybrid", "ngram-default"]
    ngram_engine = next(r for r in rows if r["kind"] == "engine" and r["config"] == "ngram-default")
    assert ngram_engine["draft_weight_bytes"] == 0 and ngram_engine["draft_vocab_size"] is None
    runs = [r for r in rows if r["kind"] == "specserve"]
    cells = {(w, c) for w in workloads for c in (1, 4)}
    labels = {"plain", "eagle3-3-pinned", "eagle3-3-adaptive", "ngram-default"} | HYBRID_LABELS
    assert {(r["workload"], r["concurrency"], r["config"]) for r in runs} == {(*cell, label) for cell in cells
                                                                          for label in labels}
    assert len(runs) == len(cells) * len(labels)      # each once: plain with the first engine only
    for r in runs:
        if r["config"] in HYBRID_LABELS:   # every pinned step drafts, from one source or the other
            assert set(r["draft_sources"]) <= {"ngram", "head"} and sum(r["draft_sources"].values()) > 0
        else:
            assert "draft_sources" not in r
    pinned = [r["draft_sources"] for r in runs if r["config"] == "eagle3-3-hybrid-pinned"]
    assert sum(s.get("ngram", 0) for s in pinned) > 0 and sum(s.get("head", 0) for s in pinned) > 0
    assert all(r["accept_length"] >= 1 for r in runs if r["config"] != "plain" and "accept_length" in r)
    assert all(r["rate"] == 1.0 for r in rows if r["kind"] == "greedy_match_rate")   # float32: plain's tokens
    table = (tmp_path / "model_drafters_table.md").read_text().splitlines()
    assert table[0].endswith("| drafting steps | drafts by source |") and len(table) == 2 + len(runs)
    hybrid_lines = [line for line in table if "-hybrid-" in line]
    assert len(hybrid_lines) == 2 * len(cells) and all("head " in line or "ngram " in line for line in hybrid_lines)
    # each engine's adaptive runs traced, one file an engine, each run named by its cell and label
    traced = {path.parent.name: path.read_text() for path in (tmp_path / "traces").glob("*/policy_trace.jsonl")}
    assert set(traced) == {"eagle3-3", "eagle3-3-hybrid", "ngram-default"}, traced.keys()
    assert "code-types c4 eagle3-3-adaptive" in traced["eagle3-3"] and "ngram-default" in traced["ngram-default"]
    # the hybrid's trace holds its source choices too (source_choice.py), the others' none
    choices = [json.loads(line) for line in traced["eagle3-3-hybrid"].splitlines() if '"e": "source"' in line]
    assert choices and all(c["kind"] in ("choose", "counterfactual") and 0 <= c["preferred"] <= c["with_trie"] <= c["bs"]
                           for c in choices)
    assert '"e": "source"' not in traced["eagle3-3"]


def test_a_cell_starts_with_an_empty_trie():
    old = NgramDrafter(NgramConfig(), one_branch=True)
    old.trie.insert([5, 6, 7, 8, 9, 10])
    fresh = model_drafters.fresh_drafter(old)
    assert fresh is not old and fresh.trie.num_nodes() == 0 < old.trie.num_nodes()
    assert (fresh.config, fresh.one_branch) == (old.config, old.one_branch)
    with pytest.raises(TrieWriterError):   # the replaced drafter was closed: its writer thread is gone
        old.writer.check()
    fresh.close()

    class Head:     # a drafter whose state is per request only: its scratch is itself
        closed = False

        def scratch(self):
            return self

        def close(self):
            self.closed = True

    head = Head()
    assert model_drafters.fresh_drafter(head) is head and not head.closed


def test_one_workload_in_rounds_gives_its_rows_and_a_greedy_match_rate(models, tmp_path, monkeypatch):  # noqa: F811
    target, head = models    # the greedy-match sample is drawn from the workloads asked for, whichever they are
    monkeypatch.setattr(model_drafters, "suite_workloads", lambda engine, ns: {"sharegpt-multiturn": (PROMPTS, WARM)})
    monkeypatch.setattr(model_drafters, "measure_copy_bandwidth", lambda device: 1e9)
    model_drafters.main(["--target", str(target), "--draft", str(head), "--algorithm", "EAGLE3", "--num-steps", "3",
                         "--device", "cpu", "--dtype", "float32", "--workloads", "sharegpt-multiturn",
                         "--concurrency", "1", "--num-prompts", "2", "--bs1-prompts", "2", "--max-new-tokens", "12",
                         "--modes", "pinned", "--rounds", "2", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "model_drafters.jsonl").read_text().splitlines()]
    runs = [(r["workload"], r["config"], r["round"]) for r in rows if r["kind"] == "specserve"]
    assert runs == [("sharegpt-multiturn", config, round_) for round_ in (0, 1)
                    for config in ("plain", "eagle3-3-pinned")]     # the modes in turn, round by round
    assert [r["rate"] for r in rows if r["kind"] == "greedy_match_rate"] == [1.0]


def test_hybrid_forecast_gives_an_engine_per_value(models, tmp_path, monkeypatch):  # noqa: F811
    """--hybrid-forecast 0 2: two hybrid engines, their tries forecasting 0 and 2 candidates."""
    target, head = models
    monkeypatch.setattr(model_drafters, "suite_workloads", lambda engine, ns: {"code-types": (PROMPTS, WARM)})
    monkeypatch.setattr(model_drafters, "measure_copy_bandwidth", lambda device: 1e9)
    candidates, make_engine = [], model_drafters.make_engine

    def made(ns, config):
        engine = make_engine(ns, config)
        candidates.append(getattr(getattr(engine.core.drafter, "ngram", None), "forecast_candidates", None))
        return engine
    monkeypatch.setattr(model_drafters, "make_engine", made)
    model_drafters.main(["--target", str(target), "--draft", str(head), "--algorithm", "EAGLE3", "--num-steps", "3",
                         "--device", "cpu", "--dtype", "float32", "--workloads", "code-types", "--concurrency", "1",
                         "--num-prompts", "2", "--bs1-prompts", "2", "--max-new-tokens", "12", "--modes", "pinned",
                         "--hybrid-modes", "pinned", "--hybrid-forecast", "0", "2", "--out", str(tmp_path)])
    rows = [json.loads(line) for line in (tmp_path / "model_drafters.jsonl").read_text().splitlines()]
    assert [r["config"] for r in rows if r["kind"] == "engine"] == [
        "eagle3-3", "eagle3-3-hybrid-forecast0", "eagle3-3-hybrid-forecast2"]
    assert candidates == [None, 0, 2]
    assert {r["config"] for r in rows if r["kind"] == "specserve"} == {
        "plain", "eagle3-3-pinned", "eagle3-3-hybrid-forecast0-pinned", "eagle3-3-hybrid-forecast2-pinned"}


def test_temperature_samples_every_mode(models, tmp_path, monkeypatch):  # noqa: F811
    """--temperature 0.8 --top-p 0.9: every timed run and its warm-up sample with them (plain's
    too); the rows carry them; the drafting mode still drafts (accept length over 1)."""
    from specserve.bench import gpu_suite
    target, head = models
    monkeypatch.setattr(model_drafters, "suite_workloads", lambda engine, ns: {"code-types": (PROMPTS, WARM)})
    monkeypatch.setattr(model_drafters, "measure_copy_bandwidth", lambda device: 1e9)
    seen, run_turn = [], gpu_suite.run_turn

    async def recording(engine, prompts, params, concurrency, label):
        seen.append((label, params))
        return await run_turn(engine, prompts, params, concurrency, label)
    monkeypatch.setattr(gpu_suite, "run_turn", recording)
    model_drafters.main(["--target", str(target), "--draft", str(head), "--algorithm", "EAGLE3", "--num-steps", "3",
                         "--device", "cpu", "--dtype", "float32", "--workloads", "code-types", "--concurrency", "1",
                         "--num-prompts", "2", "--bs1-prompts", "2", "--max-new-tokens", "24", "--modes", "pinned",
                         "--temperature", "0.8", "--top-p", "0.9", "--out", str(tmp_path)])
    assert {label.split(" t1")[0] for label, _ in seen} == {"plain", "eagle3-3-pinned", "warm-up plain",
                                                             "warm-up eagle3-3-pinned"}
    assert all(params["temperature"] == 0.8 and params["top_p"] == 0.9 for _, params in seen)
    rows = [json.loads(line) for line in (tmp_path / "model_drafters.jsonl").read_text().splitlines()]
    runs = [r for r in rows if r["kind"] == "specserve"]
    assert len(runs) == 2 and all(r["temperature"] == 0.8 and r["top_p"] == 0.9 for r in runs)
    assert next(r for r in runs if r["config"] == "eagle3-3-pinned")["accept_length"] > 1
