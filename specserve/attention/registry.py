"""Attention backends by name, imported lazily so CPU-only installs never import Triton.

The registry lives apart from base.py: the backends import the interface from base.py,
so base.py must not import them back."""
from __future__ import annotations

import logging

import torch

from specserve.attention.base import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("torch_native", "triton", "fa3")
# backends that attend prompts alone: decode and verify steps, and CUDA graphs, go to triton
PROMPTS_ONLY = ("fa3",)


def backend_name(name: str, device_type: str) -> str:
    """A backend name with "auto" resolved: triton on a GPU, torch_native on a CPU."""
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" else "torch_native"


# On a GPU, auto sends every prompt step to FA3 where it loads (sgl_kernel, a half-precision
# model): it took 0.45-0.67x flash attention's time at every chunk (2k, 8k tokens) and depth (0-30k)
# measured, and a whole 32k-token prompt 1069 against 1308 ms (H200, bf16, Qwen2.5-7B heads,
# docs/bench/h200_2026-12-05b). Without it, a prompt or chunk alone in its step goes here: torch's
# SDPA (FlashAttention-2) took 0.79-0.93x the Triton extend kernel's time, a 32k-token prompt 1314
# against 1494 ms (docs/bench/h200_2026-12-05). Steps of several prompts then stay on the Triton
# kernel: torch_native would attend them one SDPA call a prompt.
LONE_PROMPT_BACKEND = "torch_native"


def create_target_backend(attention: str, prefill: str | None, decode: str | None, device_type: str,
                          num_heads: int, num_kv_heads: int, head_dim: int,
                          dtype: torch.dtype = torch.bfloat16) -> AttentionBackend:
    """The target model's backend from the three attention flags (None: not given): one, or a
    HybridBackend where prompts take another than decode and verify steps."""
    attention, prefill, decode = (loadable(name, device_type, dtype) for name in (attention, prefill, decode))
    main = backend_name(attention, device_type)
    decode_name = backend_name(decode or main, device_type)
    if decode_name in PROMPTS_ONLY:
        decode_name = "triton"
    decoding = create_attention_backend(decode_name, num_heads, num_kv_heads, head_dim)
    auto_prompts = device_type == "cuda" and attention == "auto" and prefill in (None, "auto") \
        and decode_name == "triton"
    fa3 = auto_prompts and not why_no_fa3(device_type, dtype)
    lone_prompts = auto_prompts and not fa3
    prefill_name = "fa3" if fa3 else LONE_PROMPT_BACKEND if lone_prompts else backend_name(prefill or main, device_type)
    if prefill_name == decode_name:
        return decoding
    from specserve.attention.hybrid import HybridBackend
    return HybridBackend(create_attention_backend(prefill_name, num_heads, num_kv_heads, head_dim), decoding,
                         lone_prompts=lone_prompts)


def loadable(name: str | None, device_type: str, dtype: torch.dtype) -> str | None:
    """The flag's value, or auto (with a warning) where it names fa3 and FA3 does not run here."""
    why = why_no_fa3(device_type, dtype) if name == "fa3" else ""
    if why:
        logger.warning("attention backend fa3 serves as auto: %s", why)
        return "auto"
    return name


def why_no_fa3(device_type: str, dtype: torch.dtype) -> str:
    """"" where FA3 runs for a model in `dtype` on this device, else why not."""
    if device_type != "cuda":
        return "FA3 needs a CUDA GPU"
    from specserve.attention.fa3_backend import load_kernel
    return load_kernel(dtype)[1]


def create_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch_native":
        from specserve.attention.torch_native import TorchNativeBackend
        return TorchNativeBackend(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from specserve.attention.triton_backend import TritonBackend
        return TritonBackend(num_heads, num_kv_heads, head_dim)
    if name == "fa3":
        from specserve.attention.fa3_backend import FA3Backend
        return FA3Backend(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
