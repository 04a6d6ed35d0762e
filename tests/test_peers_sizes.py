"""The peers benchmark's workloads of fixed sizes (bench/size_workloads.py), for model sizes
served with random weights: N-token prompts for decode throughput (random-N), the time to
first token of one N-token prompt at a time (prefill-N) and decode speed with N tokens of
context (context-N), the same token ids for every engine."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specserve.bench import peers
from specserve.bench.random_model import write_model_config
from specserve.bench.size_workloads import parse
from tests.test_peers_dummy import TINY


def test_names_say_kind_and_length_and_leave_room_for_the_output():
    assert parse("code-types", 256) is None
    assert parse("random-512", 256).prompt_len == 512
    assert parse("prefill-8k", 256).prompt_len == 8192
    assert parse("context-32k", 256).prompt_len == 32768 - 256 - 64    # a 32k context holds the output too
    assert parse("prefill-32k", 256).prompt_len == 32768 - 1 - 64
    with pytest.raises(ValueError, match="random-0"):
        parse("random-0", 256)


def test_prompts_are_the_same_for_every_engine_and_within_the_vocabulary():
    size = parse("random-300", 16)
    first, again, other = size.prompts(3, 1000, 0), size.prompts(3, 1000, 0), size.prompts(3, 1000, 1)
    assert first == again != other
    assert all(len(p) == 300 and all(100 <= t < 1000 for t in p) for p in first)


def test_prefill_cells_run_one_prompt_at_a_time_with_one_token_out():
    ns = SimpleNamespace(concurrency=[8, 1, 32], sizes={"prefill-2k": parse("prefill-2k", 256),
                                                        "context-2k": parse("context-2k", 256)})
    cells = peers.engine_cells({"random-512": None, "prefill-2k": None, "context-2k": None}, ns)
    assert cells == [("random-512", 8), ("context-2k", 8), ("random-512", 1), ("prefill-2k", 1), ("context-2k", 1),
                     ("random-512", 32), ("context-2k", 32)]
    assert ns.sizes["prefill-2k"].max_tokens(256) == 1 and ns.sizes["context-2k"].max_tokens(256) == 256


def test_a_cell_reads_its_rate_as_its_kind_says():
    summary = {"tok_s": 50.0, "mean_ttft_ms": 200.0, "median_itl_ms": 10.0}
    assert peers.size_cell(parse("prefill-2k", 256), 1, summary)["tok_s"] == 2048 * 1000 / 200.0
    context = peers.size_cell(parse("context-2k", 256), 8, summary)
    assert context["tok_s"] == 8 * 1000 / 10.0 and context["output_tok_s"] == 50.0 and context["prompt_len"] == 2048
    assert peers.size_cell(parse("random-512", 256), 8, summary)["tok_s"] == 50.0


def test_specserve_runs_the_size_workloads_on_random_weights(tmp_path):
    hf_root = tmp_path / "hf"
    write_model_config(str(hf_root / "tiny"), TINY)
    out = tmp_path / "out"
    peers.run(peers.parse_args([
        "run", "--quick", "--load-format", "dummy", "--models", "tiny", "--hf-root", str(hf_root),
        "--models-dir", str(tmp_path), "--engines", "specserve-plain", "--concurrency", "1", "2",
        "--workloads", "random-40", "prefill-96", "context-64", "--max-new-tokens", "6",
        "--wheels", str(tmp_path / "no-wheels"), "--envs-root", str(tmp_path / "envs"),
        "--specserve-args", "--device cpu --dtype float32", "--out", str(out)]))
    cells = [json.loads(line) for line in open(out / "peers.jsonl")]
    cells = {(c["workload"], c["concurrency"]): c for c in cells if c["kind"] == "cell"}
    assert sorted(cells) == [("context-64", 1), ("context-64", 2), ("prefill-96", 1), ("random-40", 1),
                             ("random-40", 2)]
    assert all("error" not in c and c["tok_s"] > 0 for c in cells.values())
    prefill = cells["prefill-96", 1]
    assert prefill["prompt_len"] == 96 and prefill["output_tokens"] == prefill["prompts"]   # one token each
    assert prefill["tok_s"] == pytest.approx(96 * 1000 / prefill["mean_ttft_ms"], rel=0.01)
    assert cells["context-64", 2]["output_tokens"] == cells["context-64", 2]["prompts"] * 6
    table = open(out / "peers_table.md").read()
    assert "prefill-N cells: prompt tokens per second of time to first token" in table
    assert "context-N cells: decode tokens per second" in table
