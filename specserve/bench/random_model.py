"""A Hugging Face model directory with random weights and a real model's shapes.

Kernel timings depend on shapes, not on weight values, so the GPU decode profile can run
the Qwen2.5-Coder-1.5B architecture without staging its 1.1 GB checkpoint on the device.
The tokenizer is a small word-level one built here (token ids stay below every vocab size).
"""
from __future__ import annotations

import json
import os

import torch

SHAPES = {
    # Qwen2.5-Coder-1.5B-Instruct as its GGUF ships it (lm_head stored apart from the embedding)
    "qwen2.5-coder-1.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
                               intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                               num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                               rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen2.5-coder-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                               intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                               rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=8192),
                         rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2.5-14b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=5120,
                        intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, rope_theta=1000000.0,
                        rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False),
}


def write_random_model(directory: str, shape: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> str:
    """Writes config.json, model.safetensors (N(0, 0.02) weights) and a tokenizer; returns the path."""
    from safetensors.torch import save_file
    config = dict(SHAPES[shape], torch_dtype=str(dtype).removeprefix("torch."))
    if _written(directory, config):  # a 7-14B shape takes a minute to write: once per machine
        return directory
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    generator = torch.Generator(device=device).manual_seed(0)
    weights = {name: (torch.randn(shape_, generator=generator, device=device) * 0.02).to(dtype).cpu()
               for name, shape_ in _weight_shapes(config).items()}
    for name in weights:
        if "norm" in name:
            weights[name] = torch.ones_like(weights[name])
    save_file(weights, os.path.join(directory, "model.safetensors"))
    _word_level_tokenizer().save_pretrained(directory)
    return directory


def _written(directory: str, config: dict) -> bool:
    """The directory already holds this config's random model (and its tokenizer)."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            same = json.load(f) == json.loads(json.dumps(config))
    except (OSError, ValueError):
        return False
    return same and all(os.path.exists(os.path.join(directory, name))
                        for name in ("model.safetensors", "tokenizer.json"))


def _weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    hidden, head_dim = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (c["intermediate_size"], hidden),
            p + "mlp.up_proj.weight": (c["intermediate_size"], hidden),
            p + "mlp.down_proj.weight": (hidden, c["intermediate_size"]),
        })
        if c["model_type"] == "qwen2":  # Qwen2's q, k and v projections have biases; Llama's none
            shapes.update({p + "self_attn.q_proj.bias": (hidden,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def _word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(4000)] + list("abcdefghijklmnopqrstuvwxyz():=+-*/,.")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
