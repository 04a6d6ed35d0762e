"""lab/draft_rows.py's split of its counters by turn: a two-turn run (sharegpt-repeat's
protocol, the same requests again) leaves one entry a turn, each turn's counters from zero
and its outputs, so turn 2 (the trie holding turn 1's answers) is read apart from turn 1.
Runs on the CPU with a tiny random model."""
from __future__ import annotations

import collections

import pytest

from lab.draft_rows import watch_streams, watch_turns
from specserve.bench import gpu_suite, offline
from tests.spec_fixtures import make_tiny_directory, tiny_engine

PROMPTS = [[5, 6, 7, 8, 9] * 4, [20, 21, 22, 23] * 5, list(range(30, 50))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-draft-rows")
    make_tiny_directory(path, "llama", seed=3)
    with tiny_engine(path) as engine:
        yield engine


def test_two_turns_leave_one_entry_each_from_zero(engine, monkeypatch):
    for owner, name in ((gpu_suite, "run_turn"), (gpu_suite, "run"), (offline, "summarize")):
        monkeypatch.setattr(owner, name, getattr(owner, name))   # put back after watch_turns' wrappers
    counts, streams = collections.Counter(), collections.Counter()
    turns = watch_turns(counts, streams)
    gpu_suite.set_drafter(engine, 8, True, False)   # pinned: every step drafts what the trie has
    watch_streams(engine.core.drafter, streams)
    counts["stale"] = 5   # left by an earlier run: no turn may carry it
    gpu_suite.run(engine, PROMPTS, 2, 24, "repeat", turns=2)
    gpu_suite.set_drafter(engine, None)

    assert len(turns) == 2
    (_, first_streams, first_outputs), (second_counts, second_streams, second_outputs) = turns
    assert "stale" not in turns[0][0] and "stale" not in second_counts
    assert len(first_outputs) == len(PROMPTS) and all(0 < len(o) <= 24 for o in first_outputs)
    assert second_outputs == first_outputs   # greedy: the repeat answers as the first turn did
    # each turn's proposals are its own (a request proposes at most once a step of its 24 tokens)
    assert 0 < second_streams["proposals"] <= 24 * len(PROMPTS)
    assert 0 < first_streams["proposals"] <= 24 * len(PROMPTS)
    assert second_streams["diverged"] == first_streams["diverged"] == 0
    gpu_suite.run(engine, PROMPTS[:1], 1, 8, "again")   # a new run starts the list afresh
    assert len(turns) == 1 and len(turns[0][2]) == 1 and 0 < len(turns[0][2][0]) <= 8
