"""The peers benchmark's KV capacity: the tokens each engine's server has room for at the same
memory fraction, from /get_server_info where it has the route (specserve, SGLang), else from
the figure its start-up log states (vLLM), shown beside the engine in the table."""
from __future__ import annotations

from specserve.bench import peers_engines, peers_report

SGLANG_LOG = ("[2026-12-04 10:00:01] Load weight end. type=Qwen2ForCausalLM, avail mem=124.61 GB\n"
              "[2026-12-04 10:00:02] max_total_num_tokens=2071264, chunked_prefill_size=8192, "
              "max_prefill_tokens=16384, max_running_requests=64, context_len=32768\n")
VLLM_LOG = ("INFO 12-04 10:00:01 [gpu_worker.py:298] Available KV cache memory: 110.52 GiB\n"
            "INFO 12-04 10:00:01 [kv_cache_utils.py:1087] GPU KV cache size: 2,069,456 tokens\n"
            "INFO 12-04 10:00:01 [kv_cache_utils.py:1091] Maximum concurrency for 32,768 tokens per request: 63.15x\n")


def test_capacity_comes_from_the_server_info_where_it_has_the_route(monkeypatch):
    monkeypatch.setattr(peers_engines, "_server_info", lambda base_url: {"max_total_num_tokens": 123456})
    assert peers_engines.kv_capacity("http://x", VLLM_LOG) == 123456


def test_capacity_comes_from_the_start_up_log_without_the_route(monkeypatch):
    monkeypatch.setattr(peers_engines, "_server_info", lambda base_url: {})
    assert peers_engines.kv_capacity("http://x", VLLM_LOG) == 2069456
    assert peers_engines.kv_capacity("http://x", SGLANG_LOG) == 2071264
    assert peers_engines.kv_capacity("http://x", "KV cache: 4096 tokens (max_total_num_tokens; 0.01 GiB)") == 4096
    assert peers_engines.kv_capacity("http://x", "no such line") is None


def test_the_table_shows_each_engines_kv_tokens():
    rows = [{"kind": "engine", "model": "m", "engine": "vllm-plain", "engine_family": "vllm", "version": "vllm 0.26.0",
             "startup_s": 60.0, "kv_tokens": 2069456, "date": "2026-12-04"},
            {"kind": "engine", "model": "m", "engine": "specserve-plain", "engine_family": "specserve",
             "version": "specserve abc1234", "startup_s": 20.0, "date": "2026-12-04"}]
    lines = peers_report.engine_lines(rows)
    assert lines[0] == "| model | engine | version | date | start-up (s) | KV tokens |"
    assert "| m | vllm-plain | vllm 0.26.0 | 2026-12-04 | 60.0 | 2,069,456 |" in lines
    assert "| m | specserve-plain | specserve abc1234 | 2026-12-04 | 20.0 | ? |" in lines   # an older row
