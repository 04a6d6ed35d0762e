"""Hugging Face model directories of real models' shapes, for benchmarks without checkpoints.

Kernel timings depend on shapes, not on weight values. `write_model_config` writes only
config.json and a tokenizer: what `--load-format dummy` serves (specserve's, vLLM's and
SGLang's), with random weights made on the device at start-up. `write_random_model` also
writes those weights (model.safetensors, random_weights.py's values) for tools that load a
checkpoint. The tokenizer is a small word-level one built here (token ids stay below every
vocab size), with a chat template that joins the messages' text.
"""
from __future__ import annotations

import json
import os

import torch

from specserve.model.loader import read_model_config
from specserve.model.random_weights import RandomWeights

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


def write_model_config(directory: str, shape: str | dict, dtype: torch.dtype = torch.bfloat16) -> str:
    """Writes config.json (SHAPES[shape], or `shape` itself: a config's fields) and a
    tokenizer, no weights; returns the path."""
    config = _config_of(shape, dtype)
    if not _written(directory, config, ("tokenizer.json",)):
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f)
        _word_level_tokenizer().save_pretrained(directory)
    return directory


def write_random_model(directory: str, shape: str | dict, dtype: torch.dtype = torch.bfloat16,
                       device: str = "cuda") -> str:
    """write_model_config and model.safetensors: random weights (N(0, 0.02), norms 1, seed 0),
    made on `device`; returns the path."""
    from safetensors.torch import save_file
    if _written(directory, _config_of(shape, dtype), ("tokenizer.json", "model.safetensors")):
        return directory   # a 7-14B shape takes a minute to write: once per machine
    write_model_config(directory, shape, dtype)
    weights = RandomWeights(read_model_config(directory), dtype, device)
    save_file({name: weights[name].cpu() for name in weights}, os.path.join(directory, "model.safetensors"))
    return directory


def _config_of(shape: str | dict, dtype: torch.dtype) -> dict:
    return dict(SHAPES[shape] if isinstance(shape, str) else shape, torch_dtype=str(dtype).removeprefix("torch."))


def _written(directory: str, config: dict, files: tuple[str, ...]) -> bool:
    """The directory already holds this config and `files`."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            same = json.load(f) == json.loads(json.dumps(config))
    except (OSError, ValueError):
        return False
    return same and all(os.path.exists(os.path.join(directory, name)) for name in files)


def _word_level_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(4000)] + list("abcdefghijklmnopqrstuvwxyz():=+-*/,.")
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    # benchmarks build chat prompts (gpu_suite); the text of the messages is all a random model needs
    fast.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
    return fast
