"""bench_serving: its dataset pieces on their own, then whole runs against a real server in
a subprocess that speculates with NGRAM (native /generate with the 2-turn protocol, and the
OpenAI chat backend), so the accept length is reported too."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from specserve.bench.datasets import json_array_items, sample_random_requests, sample_sharegpt_requests
from specserve.bench.serving import RequestResult, _percentile, summarize
from lab.server_overhead import wait_healthy
from tests.server_process import ROOT, free_port, start_server, stop_server


class _WordTokenizer:
    def encode(self, texts):
        return [[len(word) for word in text.split()] for text in texts]

    def decode(self, ids):
        return [" ".join("x" * n for n in row) for row in ids]


def test_truncated_json_array_keeps_whole_items():
    text = json.dumps([{"a": 1}, {"b": [2, 3]}, {"c": "four"}])
    assert json_array_items(text) == [{"a": 1}, {"b": [2, 3]}, {"c": "four"}]
    assert json_array_items(text[:-12]) == [{"a": 1}, {"b": [2, 3]}]


def test_sharegpt_and_random_sampling():
    pairs = [("one two three", "four five"), ("x", "tiny prompt is dropped"), ("a b c d", "e")] * 4
    rows = sample_sharegpt_requests(pairs, 3, _WordTokenizer(), shuffle=False)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in rows] == [("one two three", 3, 2)] * 3
    fixed = sample_sharegpt_requests(pairs, 8, _WordTokenizer(), fixed_output_len=7, seed=3)
    assert len(fixed) == 8 and all(r.output_len == 7 and r.prompt_len >= 2 for r in fixed)
    with pytest.raises(ValueError):
        sample_sharegpt_requests(pairs, 100, _WordTokenizer())
    rows = sample_random_requests(10, 5, 20, 0.5, _WordTokenizer(), pairs, seed=0)
    assert all(5 <= r.prompt_len <= 10 and 2 <= r.output_len <= 5 for r in rows)
    assert all(len(r.prompt.split()) == r.prompt_len for r in rows)


def test_summary_metrics():
    assert _percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and _percentile([5.0], 99) == 5.0
    results = [RequestResult(success=True, prompt_len=10, output_len=5, ttft=0.1, itl=[0.05] * 4, latency=0.3),
               RequestResult(success=True, prompt_len=20, output_len=3, ttft=0.2, itl=[0.1] * 2, latency=0.4),
               RequestResult(error="boom")]
    m = summarize(results, duration=2.0, accept_length=None)
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["output_throughput"] == pytest.approx(4.0) and m["concurrency"] == pytest.approx(0.35)
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["mean_tpot_ms"] == pytest.approx(75.0)
    assert m["max_itl_ms"] == pytest.approx(100.0)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(port, "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
                        "--speculative-disable-adaptive")  # every step drafts: accept lengths show the n-gram cache
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}")
        yield SimpleNamespace(port=port)
    finally:
        stop_server(proc)


def run_bench(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "specserve.bench_serving", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_native_sharegpt_two_turns(server, tmp_path):
    out = tmp_path / "bench.jsonl"
    run = run_bench("--backend", "specserve", "--port", str(server.port), "--dataset-name", "sharegpt",
                    "--num-prompts", "4", "--sharegpt-output-len", "8", "--max-concurrency", "4",
                    "--num-turns", "2", "--disable-shuffle", "--output-file", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("Serving Benchmark Result") == 2
    for label in ("Successful requests:", "Benchmark duration (s):", "Request throughput (req/s):",
                  "Input token throughput (tok/s):", "Output token throughput (tok/s):", "Mean TTFT (ms):",
                  "Median TTFT (ms):", "P99 TTFT (ms):", "Mean TPOT (ms):", "P99 ITL (ms):", "Concurrency:",
                  "Accept length:"):
        assert label in run.stdout, label
    assert "turn 1" in run.stderr       # the progress bar
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["turn"] for r in reports] == [1, 2]
    assert reports[0]["total_input_tokens"] == reports[1]["total_input_tokens"]   # the same requests twice
    for r in reports:
        assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 32
        assert r["output_throughput"] > 0 and r["mean_ttft_ms"] > 0 and 1.0 <= r["accept_length"] <= 4.0
    assert reports[1]["accept_length"] >= reports[0]["accept_length"]   # the n-gram cache saw turn 1


def test_openai_chat_random(server, tmp_path):
    out = tmp_path / "bench.jsonl"
    run = run_bench("--backend", "openai-chat", "--port", str(server.port), "--dataset-name", "random",
                    "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "0.5",
                    "--num-prompts", "4", "--request-rate", "50", "--seed", "2", "--disable-tqdm",
                    "--output-file", str(out), "--output-details")
    assert run.returncode == 0, run.stderr[-3000:]
    [report] = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["completed"] == 4 and report["backend"] == "openai-chat" and report["request_rate"] == 50
    assert report["total_output_tokens"] == sum(report["output_len"]) and all(3 <= n <= 6 for n in report["output_len"])
    assert len(report["ttft"]) == 4 and all(t > 0 for t in report["ttft"])
    assert report["accept_length"] >= 1.0     # from the server's totals: chat responses carry no meta_info
