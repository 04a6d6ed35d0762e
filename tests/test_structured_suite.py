"""The suite's structured workloads run end to end on SmolLM2 (fp32, CPU): gpu_suite builds
`agentic-tools` and `schema-extraction` for the engine (the grammar of each request: a tool
call forced through the structural tag, or a JSON schema), times them plain and with NGRAM
at concurrency 2 (batch 1 takes the same path with fewer prompts), and every row records tok/s, its accept length under NGRAM, and that every
answer parsed and validated against its schema; the report shows it."""
from __future__ import annotations

import argparse

import pytest

from specserve.bench.gpu_suite import STRUCTURED_WORKLOADS, bench_cells, compile_grammars, main, suite_workloads
from specserve.bench.report import markdown
from specserve.bench.structured_requests import EncodedRequest
from tests.spec_fixtures import ngram_args
from tests.test_spec_greedy import smol  # noqa: F401 (fixture: SmolLM2 engines)

CONFIG = "ngram-8-one"   # pinned: every step verifies a draft under the grammar


@pytest.fixture(scope="module")
def engine(smol):
    return smol.make(**ngram_args(8), max_total_tokens=16384)


@pytest.fixture(scope="module")
def ns():
    return argparse.Namespace(workloads=list(STRUCTURED_WORKLOADS), num_prompts=2, bs1_prompts=1, max_new_tokens=224,
                              concurrency=[2], configs=[CONFIG], rounds=1, repeats=1, policy_trace_dir=None)


@pytest.fixture(scope="module")
def workloads(engine, ns):
    return suite_workloads(engine, ns)


def test_the_suite_builds_only_the_workloads_asked_for_with_their_grammars(engine, workloads):
    assert list(workloads) == list(STRUCTURED_WORKLOADS)
    agentic, _ = workloads["agentic-tools"]
    extraction, warm = workloads["schema-extraction"]
    assert all(isinstance(r, EncodedRequest) for r in agentic + extraction + warm) and len(extraction) == 2
    assert [set(r.sampling_params) for r in agentic] == [{"structural_tag"}] * 2   # a conversation's first calls
    assert all(set(r.sampling_params) == {"json_schema"} for r in extraction)
    # SmolLM2's template ignores `tools`: the signatures ride in the system prompt
    assert '"name": "get_weather"' in engine.tokenizer.decode(agentic[0].input_ids)
    assert [r.input_ids for r in extraction] != [r.input_ids for r in warm]   # warm-ups: other records


def test_a_free_workload_is_the_same_requests_without_their_grammar(engine, ns):
    free_ns = argparse.Namespace(**{**vars(ns), "workloads": ["agentic-tools", "agentic-tools-free"]})
    workloads = suite_workloads(engine, free_ns)
    assert list(workloads) == ["agentic-tools", "agentic-tools-free"]
    (constrained, warm), (free, free_warm) = workloads["agentic-tools"], workloads["agentic-tools-free"]
    assert [r.input_ids for r in free] == [r.input_ids for r in constrained]
    assert [r.input_ids for r in free_warm] == [r.input_ids for r in warm]
    assert all(r.sampling_params == {} for r in free + free_warm)
    assert all(r.sampling_params for r in constrained)   # the constrained ones keep theirs


def test_the_timed_requests_grammars_are_compiled_before_any_configuration_runs(engine, workloads, monkeypatch):
    """No configuration's first round pays the compiles: each timed grammar is in the engine's
    cache before the cell runs, and a second call compiles nothing again."""
    timed = workloads["agentic-tools"][0] + workloads["schema-extraction"][0]
    compiled = []
    compile_ = type(engine.grammars).compile
    monkeypatch.setattr(type(engine.grammars), "compile", lambda self, spec: compiled.append(spec) or compile_(self, spec))
    compile_grammars(engine, timed)
    assert len(compiled) == len(timed)
    cached = len(engine.grammars)
    compile_grammars(engine, timed)
    assert len(engine.grammars) == cached
    assert engine.grammars.compile(compiled[0]) is engine.grammars.compile(compiled[0])


def test_every_answer_validates_plain_and_with_ngram(engine, ns, workloads):
    rows = []
    bench_cells(engine, ns, "smollm2", workloads, roofline=1.0, write=rows.append)
    cells = {(r["workload"], r["concurrency"], r["config"]) for r in rows}
    assert cells == {(w, c, k) for w in STRUCTURED_WORKLOADS for c in (2,) for k in ("plain", CONFIG)}
    assert all(r["valid_fraction"] == 1.0 and r["output_tokens_per_s"] > 0 for r in rows), rows
    drafted = [r for r in rows if r["config"] == CONFIG]
    assert all(r["accept_length"] >= 1.0 for r in drafted) and max(r["accept_length"] for r in drafted) > 1.5
    assert "valid answers" in markdown(rows) and "| 100% |" in markdown(rows)


def test_an_unknown_workload_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--workloads", "agentic", "--device", "cpu"])
    assert "--workloads" in capsys.readouterr().err
