"""The serving form of an EAGLE head's draft step (eagle_serving.py) computes what the
training form does, over the same weight storage."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the row kernels are defined; 0 on a GPU

from types import SimpleNamespace

import pytest
import torch

from specserve.speculative.heads.eagle_serving import ServingEagleHead
from tests.test_eagle_head import VOCAB, causal_attention, random_head, tiny_config


class CausalBackend:
    """An attention backend over the step's own rows only (no KV pool): forward(q, k, v, layer, batch)."""

    def forward(self, q, k, v, layer, batch):
        assert layer == 0 and k is not None    # on a CPU the serving form hands k and v over, rotated
        return causal_attention(q, k, v)


@pytest.mark.parametrize("aux_layers", [(0, 1, 3), ()], ids=["eagle3", "eagle2"])
def test_serving_step_and_logits_equal_the_training_form(aux_layers):
    head = random_head(tiny_config(aux_layers))
    states = torch.randn(7, head.config.feature_size)
    tokens = torch.randint(0, VOCAB, (7,))
    positions = torch.arange(3, 10)
    with torch.no_grad():
        features = head.project(states)
        expected_hidden = head.step(tokens, features, positions, causal_attention)
        expected = head.logits(expected_hidden)
        serving = ServingEagleHead(head)
        batch = SimpleNamespace(input_ids=tokens, positions=positions)
        hidden = serving.step(batch, CausalBackend(), features)
        torch.testing.assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(serving.logits(hidden), expected, rtol=1e-5, atol=1e-5)
        # the training form, after the fusion, still computes the same (its weights are views now)
        torch.testing.assert_close(head.step(tokens, features, positions, causal_attention), expected_hidden)


def test_serving_step_on_the_row_kernels_equals_the_training_form(monkeypatch):
    """A draft step of several rows on the few-row kernels (Triton's interpreter): the
    post-attention norm by a kernel of its own before gate_up."""
    from specserve.model import rows_linear
    from specserve.speculative.heads import eagle_serving
    head = random_head(tiny_config((0, 1, 3)))
    states, tokens, positions = torch.randn(5, head.config.feature_size), torch.randint(0, VOCAB, (5,)), torch.arange(5)
    with torch.no_grad():
        features = head.project(states)
        expected = head.step(tokens, features, positions, causal_attention)
        serving = ServingEagleHead(head)
        monkeypatch.setattr(eagle_serving, "takes_row_kernels", lambda x: True)
        monkeypatch.setattr(rows_linear, "best_config", lambda *args: ((32, 32, 3, 4, 2), True))
        made = []
        real_gemm = rows_linear.rows_gemm
        monkeypatch.setattr(rows_linear, "rows_gemm", lambda *a, **k: made.append(a) or real_gemm(*a, **k))
        hidden = serving.step(SimpleNamespace(input_ids=tokens, positions=positions), CausalBackend(), features)
    torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    assert len(made) == 1   # gate_up on the row kernels (the other linears are the CPU's)


def test_fused_projections_share_the_heads_weights():
    head = random_head(tiny_config())
    layer = head.midlayer
    q_rows = layer.self_attn.q_proj.weight.shape[0]
    serving = ServingEagleHead(head).layer
    assert serving.qkv_proj.weight.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
    assert torch.equal(serving.qkv_proj.weight[q_rows:q_rows + layer.self_attn.k_proj.weight.shape[0]],
                       layer.self_attn.k_proj.weight)
    assert serving.mlp.gate_up_proj.weight.data_ptr() == layer.mlp.gate_proj.weight.data_ptr()
    assert serving.mlp.down_proj is layer.mlp.down_proj and serving.o_proj is layer.self_attn.o_proj
    assert serving.input_layernorm.weight is layer.input_layernorm.weight


def test_a_head_without_embedding_is_refused():
    head = random_head(tiny_config())
    head.embed_tokens = None
    with pytest.raises(ValueError, match="token embedding"):
        ServingEagleHead(head)
