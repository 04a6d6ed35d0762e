"""The KV pool's size on a GPU, from mem_fraction_static and what the device holds: the
arithmetic of ModelRunner._kv_tokens_here with the CUDA memory queries stood in for."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve.kv.pool import KVPool
from specserve.runner.model_runner import ModelRunner

GIB = 1024 ** 3


def budget_runner(fraction: float = 0.5):
    runner = ModelRunner.__new__(ModelRunner)   # only the fields the budget reads
    runner.args = SimpleNamespace(max_total_tokens=None, mem_fraction_static=fraction)
    runner.device = torch.device("cuda", 0)
    runner.config = SimpleNamespace(num_layers=28, head_dim=128)
    runner.dtype = torch.bfloat16
    runner.draft_kv_bytes_per_token = 0
    return runner


def with_device_memory(monkeypatch, total: int, free: int, allocated: int, reserved: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_memory_cached_by_an_engine_closed_earlier_is_ours_to_reuse(monkeypatch):
    """An 80 GiB device: this process holds 3 GiB of weights and keeps 60 GiB cached from an
    engine it closed (tp=2 after tp=1 in one process, H200 x2: the cache counted as another
    process's and the pool came out at -190108 tokens); another process uses 1 GiB."""
    total, allocated, cached, others = 80 * GIB, 3 * GIB, 60 * GIB, 1 * GIB
    with_device_memory(monkeypatch, total, free=total - allocated - cached - others,
                       allocated=allocated, reserved=allocated + cached)
    per_token = KVPool.bytes_per_token(28, 2, 128, torch.bfloat16)
    expected = int((0.5 * total - allocated - others) // per_token)
    assert budget_runner(0.5)._kv_tokens_here(2) == expected > 0


def test_kv_capacity_at_a_fraction_is_the_fraction_less_the_weights(monkeypatch):
    """An H200 (140 GiB) at 0.9 with 15 GiB of 7B weights and a 0.5 GiB CUDA context: the pool
    takes all the rest of the fraction, as SGLang's does; activations get the 14 GiB left out."""
    total, allocated, context = 140 * GIB, 15 * GIB, GIB // 2
    with_device_memory(monkeypatch, total, free=total - allocated - context, allocated=allocated, reserved=allocated)
    per_token = KVPool.bytes_per_token(28, 4, 128, torch.bfloat16)
    assert budget_runner(0.9)._kv_tokens_here(4) == int((0.9 * total - allocated - context) // per_token)


def test_a_fraction_that_leaves_too_little_for_activations_gives_some_of_the_pool(monkeypatch):
    """A 16 GiB device at 0.95 leaves 0.8 GiB out: 1.2 GiB more comes out of the pool, so the
    largest step's activations have 2 GiB."""
    total, allocated = 16 * GIB, 3 * GIB
    with_device_memory(monkeypatch, total, free=total - allocated, allocated=allocated, reserved=allocated)
    per_token = KVPool.bytes_per_token(28, 2, 128, torch.bfloat16)
    reserve = 2 * GIB - 0.05 * total
    assert budget_runner(0.95)._kv_tokens_here(2) == int((0.95 * total - allocated - reserve) // per_token)


def test_a_fraction_too_small_for_the_weights_names_the_field(monkeypatch):
    with_device_memory(monkeypatch, 80 * GIB, free=70 * GIB, allocated=10 * GIB, reserved=10 * GIB)
    with pytest.raises(ValueError, match="mem_fraction_static=0.1"):
        budget_runner(0.1)._kv_tokens_here(2)
