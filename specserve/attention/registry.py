"""Attention backends by name, imported lazily so CPU-only installs never import Triton.

The registry lives apart from base.py: the backends import the interface from base.py,
so base.py must not import them back."""
from __future__ import annotations

from specserve.attention.base import AttentionBackend

BACKEND_NAMES = ("torch_native", "triton")


def backend_name(name: str, device_type: str) -> str:
    """A backend name with "auto" resolved: triton on a GPU, torch_native on a CPU."""
    if name != "auto":
        return name
    return "triton" if device_type == "cuda" else "torch_native"


def create_target_backend(prefill: str, decode: str, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> AttentionBackend:
    """The target model's backend: one, or a HybridBackend where prompts take another than
    decode and verify steps (--prefill- / --decode-attention-backend)."""
    decoding = create_attention_backend(decode, num_heads, num_kv_heads, head_dim)
    if prefill == decode:
        return decoding
    from specserve.attention.hybrid import HybridBackend
    return HybridBackend(create_attention_backend(prefill, num_heads, num_kv_heads, head_dim), decoding)


def create_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionBackend:
    if name == "torch_native":
        from specserve.attention.torch_native import TorchNativeBackend
        return TorchNativeBackend(num_heads, num_kv_heads, head_dim)
    if name == "triton":
        from specserve.attention.triton_backend import TritonBackend
        return TritonBackend(num_heads, num_kv_heads, head_dim)
    raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
