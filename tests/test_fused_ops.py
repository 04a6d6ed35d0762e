"""The GPU's fused decoder kernels compute exactly what the torch code does (Triton's
interpreter on the CPU; with TRITON_INTERPRET=0 on a GPU machine, the compiled kernels on CUDA;
fp32 both ways)."""
from __future__ import annotations

import os

INTERPRET = os.environ.setdefault("TRITON_INTERPRET", "1") == "1"  # before the kernels are defined; 0 on a GPU

import pytest  # noqa: E402
import torch  # noqa: E402

from specserve.model import fused_ops
from specserve.model.layers import RotaryEmbedding, rms_norm  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def test_add_rmsnorm_matches_torch():
    # against layers.rms_norm, the torch code: on CUDA the RMSNorm module itself runs the
    # fused kernel (and add_and_norm updates the residual in place)
    torch.manual_seed(0)
    weight = torch.randn(48, device=DEVICE)
    x, residual = torch.randn(5, 48, device=DEVICE), torch.randn(5, 48, device=DEVICE)
    torch.testing.assert_close(fused_ops.add_rmsnorm(x, weight, 1e-6), rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5)
    expected_residual = residual + x
    fused_residual = residual.clone()
    out = fused_ops.add_rmsnorm(x, weight, 1e-6, residual=fused_residual)
    torch.testing.assert_close(fused_residual, expected_residual)
    torch.testing.assert_close(out, rms_norm(expected_residual, weight, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (14, 2), (6, 3)])   # head counts that are no power of two too
def test_rope_and_store_matches_torch_rope_and_pool_writes(heads, kv_heads):
    torch.manual_seed(1)
    head_dim, tokens = 16, 6
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None).to(DEVICE)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 3, 7, 8, 30, 63], device=DEVICE)
    slots = torch.tensor([5, 1, 9, 2, 7, 3], device=DEVICE)
    expected_q, expected_k = rope(positions, q.clone(), k.clone())
    k_buffer, v_buffer = (torch.zeros(10, kv_heads, head_dim, device=DEVICE) for _ in range(2))
    fused_ops.rope_and_store(q, k, v, rope.cos, rope.sin, positions, slots, k_buffer, v_buffer)
    torch.testing.assert_close(q, expected_q, rtol=1e-5, atol=1e-5)       # rotated in place, inside qkv
    torch.testing.assert_close(k_buffer[slots], expected_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_buffer[slots], v)
    untouched = torch.ones(10, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k_buffer[untouched].any() and not v_buffer[untouched].any()


def test_silu_mul_matches_torch():
    torch.manual_seed(2)
    gate_up = torch.randn(3, 80, device=DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-6)


def test_eagle3_input_is_the_embedding_the_two_norms_and_their_concatenation():
    torch.manual_seed(3)
    vocab, hidden, rows = 50, 48, 4
    embed, features = torch.randn(vocab, hidden, device=DEVICE), torch.randn(rows + 2, hidden, device=DEVICE)[:rows]
    embed_norm, hidden_norm = torch.randn(hidden, device=DEVICE), torch.randn(hidden, device=DEVICE)
    tokens = torch.tensor([7, 0, 49, 7], device=DEVICE)
    out = fused_ops.eagle3_input(tokens, embed, embed_norm, 1e-6, features, hidden_norm, 1e-5)
    expected = torch.cat([rms_norm(embed[tokens], embed_norm, 1e-6), rms_norm(features, hidden_norm, 1e-5)], dim=-1)
    assert out.shape == (rows, 2 * hidden)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
