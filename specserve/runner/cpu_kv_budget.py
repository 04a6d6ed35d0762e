"""The KV cache a CPU engine takes when --max-total-tokens is not given.

A GPU's cache fills what --mem-fraction-static leaves of device memory (model_runner.py); a
CPU's memory is the machine's, shared with everything else on it, and a CPU decodes a few
requests at a time, so its cache is sized to the model instead: room for one request of the
model's whole context (at least CPU_MIN_KV_TOKENS, so that models with short contexts still
batch; at most CPU_MAX_KV_TOKENS), and never more than CPU_KV_MEMORY_FRACTION of the memory
available at start. SmolLM2-135M in fp32 (45 KB a token): 8192 tokens, 0.35 GB; a fixed
32768 took 1.4 GB, and an engine 3.6 GB of memory.
"""
from __future__ import annotations

import os

CPU_MIN_KV_TOKENS = 4096
CPU_MAX_KV_TOKENS = 16384
CPU_KV_MEMORY_FRACTION = 0.1
CPU_FLOOR_KV_TOKENS = 1024   # where memory is that short, a cache this small still serves short requests


def cpu_default_kv_tokens(context_length: int, bytes_per_token: int, available_bytes: int | None) -> int:
    """KV tokens for a model of `context_length`, `bytes_per_token` of cache a token, on a
    machine with `available_bytes` of memory free for it (None: unknown, not bounded)."""
    tokens = min(max(context_length, CPU_MIN_KV_TOKENS), CPU_MAX_KV_TOKENS)
    if available_bytes is not None:
        tokens = min(tokens, max(int(CPU_KV_MEMORY_FRACTION * available_bytes) // bytes_per_token,
                                 CPU_FLOOR_KV_TOKENS))
    return tokens


def available_memory_bytes() -> int | None:
    """Memory the system can give a new allocation without swapping (Linux: MemAvailable;
    elsewhere half the physical memory); None where neither can be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (ValueError, OSError, AttributeError):
        return None
