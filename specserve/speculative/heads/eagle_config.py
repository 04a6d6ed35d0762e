"""EagleHeadConfig: the shape of an EAGLE draft head, and its config.json.

The file is the one SGLang and SpecForge read and write for `LlamaForCausalLMEagle3`: a
Llama config with one hidden layer, plus `draft_vocab_size` (the head's own vocabulary),
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids` (the target layers
whose outputs the fc fuses). `eagle_config.use_aux_hidden_state: false` marks a head that
reads the target's final-normed state instead of three layers (SGLang's EAGLE3 without
aux states); that is what we train for EAGLE-2.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from specserve.model.config import ModelConfig, _rope_from_hf
from specserve.model.hidden_capture import eagle3_layers

ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_DRAFT_VOCAB_SIZE = 32000


@dataclass(frozen=True)
class EagleHeadConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None       # HF-style without rope_theta; None = plain RoPE
    max_position_embeddings: int
    vocab_size: int                 # the target's vocabulary
    draft_vocab_size: int           # the head's lm_head rows; d2t maps them to target ids
    target_hidden_size: int
    aux_layers: tuple[int, ...]     # EAGLE-3: target layers whose outputs fc fuses; () = the final-normed state

    def __post_init__(self):
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got {self.draft_vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if any(layer < 0 for layer in self.aux_layers):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids must be non-negative, got {list(self.aux_layers)}")

    @property
    def algorithm(self) -> str:
        return "EAGLE3" if self.aux_layers else "EAGLE"

    @property
    def feature_size(self) -> int:
        """Width of the target states the head reads."""
        return self.target_hidden_size * max(len(self.aux_layers), 1)

    @property
    def has_fc(self) -> bool:
        """SGLang applies fc only to features wider than the head (its draft steps feed the
        head's own hidden-size output back without it)."""
        return self.feature_size != self.hidden_size

    @classmethod
    def for_target(cls, target: ModelConfig, algorithm: str = "EAGLE3",
                   draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
                   intermediate_size: int | None = None) -> EagleHeadConfig:
        """A head shaped like one of the target's layers (as SpecForge's configs are), its MLP
        `intermediate_size` wide where given (a smaller head to keep and carry)."""
        if intermediate_size is not None and intermediate_size <= 0:
            raise ValueError(f"intermediate_size must be positive, got {intermediate_size}")
        if algorithm not in ("EAGLE3", "EAGLE"):
            raise ValueError(f"algorithm must be EAGLE3 or EAGLE, got {algorithm!r}")
        return cls(hidden_size=target.hidden_size, intermediate_size=intermediate_size or target.intermediate_size,
                   num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
                   max_position_embeddings=target.max_position_embeddings, vocab_size=target.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, target.vocab_size), target_hidden_size=target.hidden_size,
                   aux_layers=eagle3_layers(target.num_layers) if algorithm == "EAGLE3" else ())

    def to_json_dict(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        eagle: dict[str, Any] = {"use_aux_hidden_state": bool(self.aux_layers)}
        if self.aux_layers:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "tie_word_embeddings": False, "attention_bias": False,
            "torch_dtype": torch_dtype, "eagle_config": eagle,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any], target_num_layers: int | None = None) -> EagleHeadConfig:
        """Reads a config.json; `target_num_layers` resolves the default EAGLE-3 layers of a
        config that names none."""
        _check_supported(data)
        hidden, heads = data["hidden_size"], data["num_attention_heads"]
        rope_theta, rope_scaling = _rope_from_hf(SimpleNamespace(**data))
        return cls(hidden_size=hidden, intermediate_size=data["intermediate_size"], num_heads=heads,
                   num_kv_heads=data.get("num_key_value_heads") or heads,
                   head_dim=data.get("head_dim") or hidden // heads, rms_norm_eps=float(data["rms_norm_eps"]),
                   rope_theta=rope_theta, rope_scaling=rope_scaling,
                   max_position_embeddings=data.get("max_position_embeddings", 2048),
                   vocab_size=data["vocab_size"], draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"],
                   target_hidden_size=data.get("target_hidden_size") or hidden,
                   aux_layers=_aux_layers(data.get("eagle_config") or {}, target_num_layers))


def _check_supported(data: dict[str, Any]) -> None:
    architectures = data.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ValueError(f"config.json architectures={architectures}: only {ARCHITECTURE} heads are supported")
    if data.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"config.json num_hidden_layers={data['num_hidden_layers']}: only one-layer heads are supported")
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={data['hidden_act']!r}: only silu is supported")
    if data.get("fc_norm") or data.get("norm_output") is False:
        raise ValueError("config.json fc_norm=true / norm_output=false heads are not supported")


def _aux_layers(eagle: dict[str, Any], target_num_layers: int | None) -> tuple[int, ...]:
    if not eagle.get("use_aux_hidden_state", True):
        return ()
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    if layers is not None:
        return tuple(int(layer) for layer in layers)
    if target_num_layers is None:
        raise ValueError("config.json names no eagle_config.eagle_aux_hidden_state_layer_ids: "
                         "pass the target's layer count to pick the default layers")
    return eagle3_layers(target_num_layers)
