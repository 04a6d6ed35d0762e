"""A CPU engine's default KV cache is sized to the model and the machine (a fixed 32768
tokens took 1.4 GB for SmolLM2-135M, an engine 3.6 GB): one request of the model's whole
context, within CPU_MIN_KV_TOKENS..CPU_MAX_KV_TOKENS and CPU_KV_MEMORY_FRACTION of the
memory available."""
from __future__ import annotations

from specserve.runner.cpu_kv_budget import (CPU_FLOOR_KV_TOKENS, CPU_MAX_KV_TOKENS, CPU_MIN_KV_TOKENS,
                                            available_memory_bytes, cpu_default_kv_tokens)
from tests.spec_fixtures import make_tiny_directory, tiny_engine

SMOLLM2_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4   # K and V, 30 layers, 3 KV heads of 64, fp32
GIB = 2 ** 30


def test_a_small_model_gets_its_context_not_a_fixed_32768():
    tokens = cpu_default_kv_tokens(8192, SMOLLM2_BYTES_PER_TOKEN, 16 * GIB)
    assert tokens == 8192 and tokens * SMOLLM2_BYTES_PER_TOKEN < 0.4 * GIB


def test_short_and_long_contexts_are_bounded():
    assert cpu_default_kv_tokens(256, 1024, 16 * GIB) == CPU_MIN_KV_TOKENS
    assert cpu_default_kv_tokens(131072, 1024, 16 * GIB) == CPU_MAX_KV_TOKENS
    assert cpu_default_kv_tokens(131072, 1024, None) == CPU_MAX_KV_TOKENS


def test_little_memory_shrinks_the_cache_to_a_tenth_of_it_and_no_further_than_the_floor():
    per_token = 128 * 1024   # a 7B model's fp32 cache
    assert cpu_default_kv_tokens(32768, per_token, 8 * GIB) == int(0.1 * 8 * GIB) // per_token == 6553
    assert cpu_default_kv_tokens(32768, per_token, GIB // 4) == CPU_FLOOR_KV_TOKENS


def test_available_memory_is_read_on_this_machine():
    available = available_memory_bytes()
    assert available is not None and 0 < available < 2 ** 50


def test_an_engine_without_max_total_tokens_sizes_its_cache_from_the_model(tmp_path):
    path = tmp_path / "tiny"
    make_tiny_directory(path)
    engine = tiny_engine(path)
    try:
        runner = engine.core.runner
        per_token = runner.pool.k_buffers[0][0].numel() * runner.pool.k_buffers[0].element_size() * 2 \
            * len(runner.pool.k_buffers)
        assert runner.pool.size == cpu_default_kv_tokens(runner.context_length, per_token, available_memory_bytes())
        assert runner.pool.size <= CPU_MAX_KV_TOKENS and runner.pool.size != 32768
    finally:
        engine.shutdown()
