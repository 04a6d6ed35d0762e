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
from specserve.bench.serving import arrivals as arrivals_of
from specserve.bench.size_workloads import full_batch_gaps, parse
from tests.test_peers_dummy import TINY


def test_names_say_kind_and_length_and_leave_room_for_the_output():
    assert parse("code-types", 256) is None
    assert parse("random-512", 256).prompt_len == 512
    assert parse("prefill-8k", 256).prompt_len == 8192
    assert (parse("random-2k", 256).prompt_len, parse("random-2k", 256).output_len) == (2048, 256)
    # a 32k context holds the output too, and a context-N output is N/16 tokens at least
    assert (parse("context-32k", 256).prompt_len, parse("context-32k", 256).output_len) == (32768 - 2048 - 64, 2048)
    assert parse("context-2k", 256).output_len == 256
    assert (parse("prefill-32k", 256).prompt_len, parse("prefill-32k", 256).output_len) == (32768 - 1 - 64, 1)
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


def _result(start: float, first: float, gaps: list[float]) -> SimpleNamespace:
    return SimpleNamespace(start=start, ttft=first, itl=gaps)


def test_a_full_batch_is_while_every_request_of_the_wave_decodes():
    # three requests' token times: the third starts late (a prefill after the others') and the first
    # ends early; only gaps ending in [3.9, 5], when all three decode, are a full batch's
    arrivals = [[1.0, 2.0, 3.0, 4.0, 5.0], [1.5, 2.5, 3.5, 4.5, 5.5, 6.5], [3.9, 4.4, 4.9, 5.4]]
    assert sorted(full_batch_gaps(arrivals, 3)) == pytest.approx([0.5, 0.5, 1.0, 1.0, 1.0])
    assert len(full_batch_gaps(arrivals, 1)) == 4 + 5 + 3
    assert full_batch_gaps([[1.0, 2.0], [3.0, 4.0]], 2) == []     # the first ended before the second began
    assert arrivals_of(_result(10.0, 0.5, [0.25, 0.25])) == [10.5, 10.75, 11.0]


def test_a_cell_reads_its_rate_as_its_kind_says_never_from_streamed_text():
    summary = {"tok_s": 50.0, "prompts": 2, "output_tokens": 8, "mean_ttft_ms": 0.0, "median_itl_ms": 0.0,
               "mean_latency_ms": 200.0}
    # prefill: one-token requests' whole latency is their time to first token
    assert peers.size_cell(parse("prefill-2k", 256), 1, summary, [])["tok_s"] == 2048 * 1000 / 200.0
    # context: two requests of 4 tokens 10 ms apart while both decode
    both = [_result(0.0, 1.0, [0.01, 0.01, 0.01]), _result(0.0, 1.005, [0.01, 0.01, 0.01])]
    context = peers.size_cell(parse("context-2k", 256), 2, summary, both)
    assert context["tok_s"] == pytest.approx(2 * 1000 / 10.0) and context["output_tok_s"] == 50.0
    assert context["prompt_len"] == 2048 and context["full_batch_gaps"] == 5
    apart = [_result(0.0, 1.0, [0.01]), _result(0.0, 2.0, [0.01])]
    context = peers.size_cell(parse("context-2k", 256), 2, summary, apart)
    assert context["tok_s"] is None and "all 2 requests were decoding" in context["error"]
    random = peers.size_cell(parse("random-512", 256), 2, summary, both)
    assert random["tok_s"] == 50.0 and random["full_batch_tok_s"] == pytest.approx(2 * 1000 / 10.0)


def test_engines_get_a_context_as_long_as_the_longest_request(tmp_path):
    hf_root = tmp_path / "hf"
    write_model_config(str(hf_root / "tiny"), {**TINY, "max_position_embeddings": 32768})
    ns = peers.parse_args(["run", "--quick", "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "16",
                           "--workloads", "random-512"])
    peers.build_workloads(str(hf_root / "tiny"), ns)
    assert ns.context_length == 4096
    ns = peers.parse_args(["run", "--quick", "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "16",
                           "--workloads", "random-512", "context-32k"])
    workloads = peers.build_workloads(str(hf_root / "tiny"), ns)
    assert ns.context_length == 32768 and len(workloads["context-32k"][0][0]) == 32768 - 2048 - 64
    for name in ("specserve-plain", "vllm-plain", "sglang-plain"):
        command = " ".join(peers.ENGINES[name].command("/hf/m", "m", 8000, context_length=ns.context_length))
        assert "4096" not in command and ("--context-length 32768" in command or "--max-model-len 32768" in command)


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
    assert prefill["tok_s"] == pytest.approx(96 * 1000 / prefill["mean_latency_ms"], rel=0.01)
    context = cells["context-64", 2]
    assert context["output_tokens"] == context["prompts"] * 6 and context["full_batch_gaps"] > 0
    table = open(out / "peers_table.md").read()
    assert "prefill-N cells: prompt tokens per second of time to first token" in table
    assert "context-N cells: decode tokens per second" in table
