"""The TTFT breakdown (lab/ttft_breakdown.py) on scripted steps, and the prefix-cache
benchmark (lab/prefix_cache.py) end to end on SmolLM2: one engine runs both modes, the
modes alternate across rounds, and each phase's TTFT splits into queue + prefill."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from lab import prefix_cache
from lab.ttft_breakdown import StepTrace, fit_prefill_cost
from specserve.engine.step_events import StepEvents
from specserve.request.req import Batch


def _req(rid: str) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, arrival_time=time.perf_counter(), first_token_time=None, finished=False)


class ScriptedCore:
    """A core whose steps run a fixed list of (batch, requests that get their first token),
    with the step events of EngineCore.step."""

    def __init__(self, script):
        self.script = list(script)
        self.events = StepEvents()

    def step(self):
        self.events.began()
        batch, firsts = self.script.pop(0)
        self.events.scheduled(batch)
        time.sleep(0.002)
        for req in firsts:
            req.first_token_time = time.perf_counter()
        self.events.ended()
        return []


def test_breakdown_splits_ttft_into_queue_own_and_other_steps():
    a, b = _req("a"), _req("b")
    b.first_token_time = a.arrival_time   # b decodes throughout
    core = ScriptedCore([
        (Batch(reqs=[b], is_extend=False), []),                                   # a waits behind a decode step
        (Batch(reqs=[a], is_extend=True, extend_lens=[10], samples=[False]), []),  # a's first chunk
        (Batch(reqs=[b], is_extend=False), []),                                   # the pacer's decode turn
        (Batch(reqs=[b, a], is_extend=True, extend_lens=[1, 5], samples=[True, True]), [a]),   # mixed: a ends
        (Batch(reqs=[a, b], is_extend=False), []),
    ])
    trace = StepTrace(core)
    for _ in range(5):
        core.step()
    got = trace.requests["a"]
    assert (got.own_steps, got.other_steps, got.computed_tokens) == (2, 1, 15)
    assert got.first_token_s == a.first_token_time
    assert got.queue_s >= 0.002 and got.own_s >= 0.004 and got.other_s >= 0.002
    assert got.queue_s + got.prefill_s == pytest.approx(a.first_token_time - a.arrival_time)
    assert "b" not in trace.requests                 # it decoded: no prompt chunk of its own
    assert [tokens for tokens, _ in trace.prefill_steps] == [10]   # the mixed step also decoded: not a prefill step
    summary = trace.summary(["a", "b"])
    assert summary["own_steps"] == 2 and summary["computed_tokens"] == 15


def test_a_request_that_fails_before_its_first_token_is_left_out():
    a = _req("a")
    core = ScriptedCore([(Batch(reqs=[a], is_extend=True, extend_lens=[4], samples=[True]), [])])
    trace = StepTrace(core)
    a.finished = True
    core.step()
    assert trace.requests["a"].first_token_s is None
    assert trace.summary(["a"]) == {}


def test_prefill_cost_fit_separates_fixed_and_per_token_cost():
    steps = [(tokens, 0.020 + 1e-5 * tokens) for tokens in (50, 100, 400, 800)]
    fit = fit_prefill_cost(steps)
    assert fit["fixed_s"] == pytest.approx(0.020) and fit["per_token_s"] == pytest.approx(1e-5)
    assert fit_prefill_cost([(100, 0.02), (100, 0.03)]) == {}
    lengths = [16, 100, 300, 1000, 2000]   # lab.prefill_cost's default lengths: 20 ms + 6 us per token
    fit = fit_prefill_cost([(n, 0.020 + 6e-6 * n) for n in lengths])
    assert fit["fixed_s"] == pytest.approx(0.020) and fit["per_token_s"] == pytest.approx(6e-6)


def test_modes_alternate_which_runs_first():
    assert prefix_cache.mode_schedule(3, "on") == ["on", "off", "off", "on", "on", "off"]
    assert prefix_cache.mode_schedule(1, "off") == ["off", "on"]


def test_bench_runs_both_modes_on_one_engine(capsys):
    rows = prefix_cache.main(["--device", "cpu", "--workloads", "multiturn", "--num-requests", "2",
                              "--max-concurrency", "2", "--output-len", "4", "--max-conversation-chars", "800",
                              "--rounds", "2", "--skip-server-warmup", "--log-level", "warning"])
    by_key = {(row["phase"], row["cache"]): row for row in rows}
    assert set(by_key) == {("turn 1", "on"), ("turn 2", "on"), ("turn 1", "off"), ("turn 2", "off")}
    assert all(row["requests"] == 4 for row in rows)          # 2 conversations x 2 rounds
    assert by_key[("turn 2", "on")]["cache_hit_rate"] > 0.3
    assert by_key[("turn 2", "off")]["cache_hit_rate"] == 0
    for row in rows:   # the breakdown adds up to the TTFT the engine reports
        assert row["ttft_queue_s"] + row["ttft_prefill_s"] == pytest.approx(row["mean_ttft_s"], abs=1e-3)
        assert row["ttft_own_steps"] >= 1
    on, off = by_key[("turn 2", "on")], by_key[("turn 2", "off")]
    assert on["ttft_computed_tokens"] < off["ttft_computed_tokens"]
    out = capsys.readouterr().out
    assert "greedy outputs identical with and without the cache: 8/8" in out
