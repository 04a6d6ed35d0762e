"""The EAGLE head: saved and loaded in SGLang/SpecForge's layout it computes the same;
SpecForge-named state dicts load; the training-time test's unrolled steps equal drafting a
chain step by step as the engine will."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specserve.speculative.heads.eagle_checkpoint import load_head, load_head_state, save_head
from specserve.speculative.heads.eagle_config import EagleHeadConfig
from specserve.speculative.heads.eagle_head import EagleHead
from specserve.training.eagle_ttt import ConversationBatch, unroll

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 50, 32, 4, 2, 8


def tiny_config(aux_layers=(0, 1, 3), draft_vocab_size=20) -> EagleHeadConfig:
    return EagleHeadConfig(hidden_size=HIDDEN, intermediate_size=48, num_heads=HEADS, num_kv_heads=KV_HEADS,
                           head_dim=HEAD_DIM, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                           max_position_embeddings=128, vocab_size=VOCAB, draft_vocab_size=draft_vocab_size,
                           target_hidden_size=HIDDEN, aux_layers=aux_layers)


def random_head(config: EagleHeadConfig, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    head = EagleHead(config)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)   # a dropped norm weight shows
    head.set_draft_vocab(torch.randperm(VOCAB)[:config.draft_vocab_size].sort().values)
    head.share_embedding(torch.randn(VOCAB, HIDDEN))
    return head


def causal_attention(q, k, v):
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
                                         v.repeat_interleave(group, 1).transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def draft_logits(head: EagleHead, target_states, tokens) -> torch.Tensor:
    features = head.project(target_states)
    return head.logits(head.step(tokens, features, torch.arange(tokens.numel()), causal_attention))


@pytest.mark.parametrize("aux_layers", [(0, 1, 3), ()], ids=["eagle3", "eagle2"])
def test_saved_and_loaded_head_computes_the_same(tmp_path, aux_layers):
    head = random_head(tiny_config(aux_layers))
    save_head(head, str(tmp_path))
    loaded = load_head(str(tmp_path))
    loaded.share_embedding(head.embed_tokens.weight)
    states = torch.randn(6, head.config.feature_size)
    tokens = torch.randint(0, VOCAB, (6,))
    with torch.no_grad():
        torch.testing.assert_close(draft_logits(loaded, states, tokens), draft_logits(head, states, tokens),
                                   atol=0, rtol=0)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    assert torch.equal(loaded.draft_vocab()[loaded.t2d[loaded.draft_vocab()]], loaded.draft_vocab())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 20
    assert config["eagle_config"]["use_aux_hidden_state"] == bool(aux_layers)
    assert config["eagle_config"].get("eagle_aux_hidden_state_layer_ids", []) == list(aux_layers)
    assert (head.fc is None) == (not aux_layers)


def specforge_state_dict(config: EagleHeadConfig) -> dict[str, torch.Tensor]:
    """The names and shapes SpecForge's LlamaForCausalLMEagle3 saves (its embedding dropped)."""
    hidden, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (config.draft_vocab_size, hidden),
              "midlayer.hidden_norm.weight": (hidden,), "midlayer.input_layernorm.weight": (hidden,),
              "midlayer.post_attention_layernorm.weight": (hidden,),
              "midlayer.self_attn.q_proj.weight": (q, 2 * hidden), "midlayer.self_attn.k_proj.weight": (kv, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * hidden), "midlayer.self_attn.o_proj.weight": (hidden, q),
              "midlayer.mlp.gate_proj.weight": (config.intermediate_size, hidden),
              "midlayer.mlp.up_proj.weight": (config.intermediate_size, hidden),
              "midlayer.mlp.down_proj.weight": (hidden, config.intermediate_size)}
    state = {name: torch.randn(shape) for name, shape in shapes.items()}
    hot = torch.arange(config.draft_vocab_size) * 2
    state["d2t"] = hot - torch.arange(config.draft_vocab_size)
    state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
    state["t2d"][hot] = True
    return state


def test_specforge_state_dict_loads():
    config = tiny_config()
    state = specforge_state_dict(config)
    head = EagleHead(config)
    load_head_state(head, {("model." + k if k.startswith("midlayer") else k): v for k, v in state.items()})
    assert torch.equal(head.midlayer.self_attn.k_proj.weight, state["midlayer.self_attn.k_proj.weight"])
    assert torch.equal(head.fc.weight, state["fc.weight"])
    assert head.to_target_ids(torch.tensor([0, 3, 19])).tolist() == [0, 6, 38]

    without_t2d = {k: v for k, v in state.items() if k != "t2d"}
    load_head_state(head, without_t2d)          # SGLang reads d2t only: t2d is derived
    assert torch.equal(head.t2d, state["t2d"])


def test_bad_checkpoints_are_refused():
    config = tiny_config()
    head = EagleHead(config)
    state = specforge_state_dict(config)
    with pytest.raises(ValueError, match="missing weights.*fc.weight"):
        load_head_state(head, {k: v for k, v in state.items() if k != "fc.weight"})
    with pytest.raises(ValueError, match="unexpected weights.*midlayer.extra"):
        load_head_state(head, {**state, "midlayer.extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="lm_head.weight has shape"):
        load_head_state(head, {**state, "lm_head.weight": torch.zeros(3, HIDDEN)})
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        EagleHeadConfig.from_json_dict({**config.to_json_dict(), "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="architectures"):
        EagleHeadConfig.from_json_dict({**config.to_json_dict(), "architectures": ["LlamaForCausalLM"]})
    layerless = config.to_json_dict()
    del layerless["eagle_config"]
    with pytest.raises(ValueError, match="layer count"):
        EagleHeadConfig.from_json_dict(layerless)
    assert EagleHeadConfig.from_json_dict(layerless, target_num_layers=28).aux_layers == (1, 13, 24)


class ChainAttention:
    """Serving-time attention of one chain: the prefix's step-0 keys, then the chain's own."""

    def __init__(self, prefix_keys, prefix_values):
        self.keys, self.values = [prefix_keys], [prefix_values]

    def __call__(self, q, k, v):
        self.keys.append(k)
        self.values.append(v)
        keys, values = torch.cat(self.keys), torch.cat(self.values)
        group = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
                                             values.repeat_interleave(group, 1).transpose(0, 1))
        return out.transpose(0, 1)


class RecordingCausal:
    def __call__(self, q, k, v):
        self.k, self.v = k, v
        return causal_attention(q, k, v)


@torch.no_grad()
def test_unrolled_steps_equal_chain_drafting():
    head = random_head(tiny_config()).eval()
    length, steps = 12, 4
    tokens = torch.randint(0, VOCAB, (2, length))
    states = torch.randn(2, length, head.config.feature_size)
    batch = ConversationBatch(tokens, torch.tensor([length, length - 3]), torch.tensor([2, 2]), states)
    outputs = unroll(head, batch, steps)
    for row in (0, 1):
        for root in (2, 5, 8):   # the chain after token `root`: step 0 at row root - 1
            prefix = RecordingCausal()
            features = head.step(tokens[row, 1:root + 1], head.project(states[row, :root]), torch.arange(root), prefix)
            feature = features[-1:]
            chain = ChainAttention(prefix.k, prefix.v)
            for step in range(steps):
                if step:
                    token = tokens[row, root + step:root + step + 1]
                    feature = head.step(token, feature, torch.tensor([root - 1 + step]), chain)
                torch.testing.assert_close(feature[0], outputs[step][row, root - 1], atol=1e-5, rtol=1e-5)


def test_unrolled_learning_rows_equal_the_full_unroll_with_its_gradients():
    """The later steps run only at the rows some step learns from: there they compute what
    every row computes when all run (outputs and the gradients of a loss over them)."""
    head = random_head(tiny_config())
    steps, lengths, prompt_lens = 4, torch.tensor([14, 9, 6]), torch.tensor([6, 2, 4])
    tokens = torch.randint(0, VOCAB, (3, 14))
    batch = ConversationBatch(tokens, lengths, prompt_lens, torch.randn(3, 14, head.config.feature_size))
    rows = batch.learning_rows(steps)
    # rows 2..11 (prompt 6, length 14), 0..6 and 0..3: where one of 4 steps predicts an answer token after the first
    assert rows.tolist() == list(range(2, 12)) + list(range(14, 21)) + list(range(28, 32))

    def loss_and_grads(outputs):
        head.zero_grad()
        loss = sum((step + 1) * output.square().sum() for step, output in enumerate(outputs))
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}

    full = [output.reshape(3 * 14, -1)[rows] for output in unroll(head, batch, steps)]
    subset = unroll(head, batch, steps, rows)
    for want, got in zip(full, subset):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    want_loss, want_grads = loss_and_grads(full)
    got_loss, got_grads = loss_and_grads(subset)
    torch.testing.assert_close(got_loss, want_loss)
    assert want_grads.keys() == got_grads.keys() and "midlayer.self_attn.k_proj.weight" in got_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
