"""The model's shape: one frozen `ModelConfig`, and its translation from the two places a
checkpoint describes itself (a transformers config, or GGUF metadata).

Everything downstream (decoder, KV cache sizing, rope tables, drafters) reads this object
and never the source config, so the quirks of each format are settled here once. It also
says which parameters (Hugging Face names and shapes) a checkpoint of this shape holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# model_type (transformers) and general.architecture (GGUF) use the same short names.
_ARCHITECTURE_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# The llama3 rope parameters every released Llama 3.x uses; GGUF keeps only the per-dim
# factors they produce, so these are the candidates we check those factors against.
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _unsupported(architecture: str) -> ValueError:
    return ValueError(
        f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _eos_tuple(*sources: int | Iterable[int] | None) -> tuple[int, ...]:
    """Merge eos ids from several places (config, generation config), keeping first-seen order."""
    ids: list[int] = []
    for source in sources:
        if source is None:
            continue
        for token_id in [source] if isinstance(source, int) else source:
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _clean_float(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); return the shortest
    decimal that round-trips the float32, which is what the original config said."""
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF-style, without rope_theta; None means plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v projections carry a bias (o_proj does not)
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before rope
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> ModelConfig:
        """Build from a transformers PretrainedConfig (and, optionally, its GenerationConfig,
        whose eos list is often longer: chat models stop on <|im_end|> as well as <|endoftext|>)."""
        architectures = getattr(hf_config, "architectures", None) or []
        model_type = getattr(hf_config, "model_type", "")
        architecture = architectures[0] if architectures else _ARCHITECTURE_BY_MODEL_TYPE.get(model_type, model_type)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise _unsupported(architecture)

        # Llama/Qwen3 `attention_bias` also puts a bias on o_proj, and `mlp_bias` on the MLP;
        # no released checkpoint of these families uses them and the decoder has no slot for
        # them, so refuse rather than silently drop weights.
        if architecture != "Qwen2ForCausalLM" and getattr(hf_config, "attention_bias", False):
            raise ValueError(f"{architecture} with attention_bias=True is not supported")
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError(f"{architecture} with mlp_bias=True is not supported")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{architecture} with use_sliding_window=True is not supported")

        rope_theta, rope_scaling = _rope_from_hf(hf_config)
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        generation_eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
        return cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=_eos_tuple(getattr(hf_config, "eos_token_id", None), generation_eos),
        )

    @classmethod
    def from_gguf(
        cls,
        metadata: Mapping[str, Any],
        *,
        vocab_size: int,
        has_output_weight: bool,
        rope_freqs: np.ndarray | None = None,
    ) -> ModelConfig:
        """Build from GGUF key/value metadata (scalars only; the token list is summarised by
        `vocab_size`). `has_output_weight` is False for tied embeddings, since llama.cpp then
        writes no `output.weight`; `rope_freqs` is the `rope_freqs.weight` tensor that llama3
        rope scaling leaves behind in place of its parameters."""
        model_type = metadata.get("general.architecture", "")
        architecture = _ARCHITECTURE_BY_MODEL_TYPE.get(model_type)
        if architecture is None:
            raise _unsupported(f"{model_type} (GGUF general.architecture)")

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{model_type}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {model_type}.{name}")
            return value

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        head_dim = int(key("attention.key_length", hidden_size // num_heads))
        rope_theta = _clean_float(key("rope.freq_base", 10000.0))
        rope_scaling = _rope_from_gguf(metadata, model_type, rope_freqs, rope_theta, head_dim)
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        eot = metadata.get("tokenizer.ggml.eot_token_id")  # e.g. <|eot_id|> for Llama 3 instruct
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=_clean_float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(key("context_length")),
            tie_word_embeddings=not has_output_weight,
            qkv_bias=architecture == "Qwen2ForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=_eos_tuple(eos, eot),
        )

    def to_hf(self) -> Any:
        """The equivalent transformers config, to build a reference model in tests (GGUF
        sources have no config.json of their own)."""
        from transformers import AutoConfig

        model_type = next(k for k, v in _ARCHITECTURE_BY_MODEL_TYPE.items() if v == self.architecture)
        return AutoConfig.for_model(
            model_type,
            architectures=[self.architecture],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        )

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter a checkpoint of this shape holds (Hugging Face names), with its shape."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "model.embed_tokens.weight": (self.vocab_size, self.hidden_size),
            "model.norm.weight": (self.hidden_size,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, self.hidden_size)
        for layer in range(self.num_layers):
            prefix = f"model.layers.{layer}."
            shapes[prefix + "input_layernorm.weight"] = (self.hidden_size,)
            shapes[prefix + "post_attention_layernorm.weight"] = (self.hidden_size,)
            shapes[prefix + "self_attn.q_proj.weight"] = (q_size, self.hidden_size)
            shapes[prefix + "self_attn.k_proj.weight"] = (kv_size, self.hidden_size)
            shapes[prefix + "self_attn.v_proj.weight"] = (kv_size, self.hidden_size)
            shapes[prefix + "self_attn.o_proj.weight"] = (self.hidden_size, q_size)
            if self.qkv_bias:
                shapes[prefix + "self_attn.q_proj.bias"] = (q_size,)
                shapes[prefix + "self_attn.k_proj.bias"] = (kv_size,)
                shapes[prefix + "self_attn.v_proj.bias"] = (kv_size,)
            if self.qk_norm:
                shapes[prefix + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[prefix + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes[prefix + "mlp.gate_proj.weight"] = (self.intermediate_size, self.hidden_size)
            shapes[prefix + "mlp.up_proj.weight"] = (self.intermediate_size, self.hidden_size)
            shapes[prefix + "mlp.down_proj.weight"] = (self.hidden_size, self.intermediate_size)
        return shapes


def _rope_from_hf(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 5's `rope_parameters` (theta
    inside the dict) or the older `rope_theta` + `rope_scaling` attributes."""
    parameters = getattr(hf_config, "rope_parameters", None)
    if parameters is None:
        parameters = dict(getattr(hf_config, "rope_scaling", None) or {})
        parameters.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    # Per-layer-type dicts ({"full_attention": {...}}) belong to models we do not support.
    if "rope_theta" not in parameters and all(isinstance(v, dict) for v in parameters.values()) and parameters:
        raise ValueError(f"per-layer rope parameters are not supported: {sorted(parameters)}")
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    # Old configs spell the type as "type"; settle on "rope_type".
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    rope_theta = float(parameters.get("rope_theta", 10000.0))
    if scaling.get("rope_type", "default") == "default":
        return rope_theta, None
    return rope_theta, scaling


def _rope_from_gguf(
    metadata: Mapping[str, Any], model_type: str, rope_freqs: np.ndarray | None, rope_theta: float, head_dim: int
) -> dict | None:
    scaling_type = metadata.get(f"{model_type}.rope.scaling.type")
    if rope_freqs is not None:
        return _llama3_rope_from_factors(np.asarray(rope_freqs, dtype=np.float64), rope_theta, head_dim)
    if scaling_type in (None, "none"):
        return None
    factor = metadata.get(f"{model_type}.rope.scaling.factor")
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": _clean_float(factor)}
    if scaling_type == "yarn":
        scaling = {"rope_type": "yarn", "factor": _clean_float(factor)}
        original = metadata.get(f"{model_type}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")


def _llama3_rope_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover the llama3 rope_scaling dict from llama.cpp's per-dimension divisors.

    llama.cpp bakes llama3 scaling into `rope_freqs` (inv_freq is divided by it): 1 for
    short wavelengths, `factor` for long ones, a smooth blend between. The blend's three
    parameters are not identifiable from the divisors alone, so take `factor` from the
    largest divisor, recompute with the values all Llama 3.x releases use, and refuse if
    they do not reproduce the tensor.
    """
    scaling = {"rope_type": "llama3", "factor": _clean_float(factors.max()), **_LLAMA3_ROPE_DEFAULTS}
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / inv_freq
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    expected = 1.0 / ((1 - smooth) / factor + smooth)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise ValueError("GGUF rope_freqs does not match llama3 rope scaling with the standard parameters")
    return scaling
