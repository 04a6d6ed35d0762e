"""lab.hybrid_step_kinds: a policy trace's steps split by kind, from the choice before each."""
from __future__ import annotations

import json

import pytest

from lab.hybrid_step_kinds import runs_of, step_kinds


def step(ms: float, tokens: int, tree: int = 4) -> dict:
    return {"e": "step", "ms": ms, "tokens": tokens, "tree": tree, "plain": tree == 1}


def choose(taken: int) -> dict:
    return {"e": "source", "kind": "choose", "taken": taken}


def test_a_hybrids_steps_are_split_by_the_choice_before_each():
    events = [step(1.5, 1, tree=1),
              choose(1), step(2.7, 12),                      # trie drafts taken
              choose(0), step(5.0, 4),                       # the head's, after a trie step: a restart
              {"e": "source", "kind": "counterfactual", "taken": False}, step(2.0, 4),   # chained
              choose(1), step(2.6, 10),
              choose(0), step(4.0, 3)]
    totals = step_kinds(events)
    assert totals["plain"] == {"steps": 1, "ms": 1.5, "tokens": 1}
    assert totals["trie"] == {"steps": 2, "ms": pytest.approx(5.3), "tokens": 22}
    assert totals["restart"] == {"steps": 2, "ms": pytest.approx(9.0), "tokens": 7}
    assert totals["head"] == {"steps": 1, "ms": 2.0, "tokens": 4}


def test_a_single_sources_steps_are_drafts_and_warm_ups_are_left_out(tmp_path):
    path = tmp_path / "policy_trace.jsonl"
    path.write_text("\n".join(json.dumps({"run": run, **event}) for run, event in
                              (("code c1 warm-up x", step(9.0, 9)), ("code c1 x", step(2.0, 5)),
                               ("code c1 x", step(1.4, 1, tree=1)))))
    runs = runs_of(path)
    assert list(runs) == ["code c1 x"]
    totals = step_kinds(runs["code c1 x"])
    assert totals["draft"] == {"steps": 1, "ms": 2.0, "tokens": 5} and totals["plain"]["steps"] == 1
