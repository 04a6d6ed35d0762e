"""An MTP head (DeepSeek-V3's multi-token prediction module, SGLang's NEXTN): one dense
decoder layer that reads the target's state of position r and the embedding of the token
at r + 1, and predicts the token at r + 2, the row layout of an EAGLE head (eagle_runner.py).

One step, for N rows:

    x      = eh_proj(concat(enorm(embed(token)), hnorm(h_target)))     (N, 2 * hidden) -> (N, hidden)
    h      = decoder_layer(x)              a Llama / Qwen2 / Qwen3 layer of the target's family
    logits = head(norm(h))                 the head's own norm and lm_head, or the target's

The target state is its final-normed state (the lm_head's input), as SGLang and vLLM hand
it to DeepSeek's MTP layer. The embedding, the head norm and the lm_head are the checkpoint's
own when it ships them (DeepSeek's `shared_head.norm`, `shared_head.head`), else the
target's (`share_target`). The checkpoint layout is mtp_checkpoint.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.attention.base import AttentionBackend, ForwardBatch
from specserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specserve.model.layers import RMSNorm
from specserve.model.llama import DecoderLayer, DecoderLM
from specserve.model.rope import RotaryEmbedding

# SGLang names a draft checkpoint holding only the MTP layer <target architecture> + this
# (scripts/export_deepseek_nextn.py writes DeepseekV3ForCausalLMNextN)
NEXTN_SUFFIX = "NextN"


@dataclass(frozen=True)
class MtpHeadConfig:
    layer: ModelConfig          # the decoder layer's shape (num_layers 1)
    target_num_layers: int      # N: the layer's checkpoint names are model.layers.{N}.*

    # --- what EagleHeadRunner and draft_setup read from a head's config ---
    algorithm = "MTP"

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return ()       # the head reads the target's final-normed state

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        return self.layer.hidden_size

    @property
    def num_heads(self) -> int:
        return self.layer.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.layer.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layer.head_dim

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def draft_vocab_size(self) -> int:
        return self.layer.vocab_size

    @classmethod
    def for_target(cls, target: ModelConfig) -> MtpHeadConfig:
        """A layer shaped like the target's (as released MTP modules are)."""
        return cls(layer=replace(target, num_layers=1), target_num_layers=target.num_layers)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> MtpHeadConfig:
        """The config.json of a NextN checkpoint: the target's config with architectures
        [<target architecture>NextN] (or the target's own, when the MTP layer is read from
        the target's directory) and num_hidden_layers the target's."""
        architectures = data.get("architectures") or []
        architecture = architectures[0].removesuffix(NEXTN_SUFFIX) if architectures else ""
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"config.json architectures={architectures}: MTP heads with a dense "
                             f"{' / '.join(a.removesuffix('ForCausalLM') for a in SUPPORTED_ARCHITECTURES)} "
                             "layer are supported (DeepSeek's MLA / MoE layers and Qwen3-Next's hybrid ones are not)")
        target_layers = data.get("num_hidden_layers")
        if not isinstance(target_layers, int) or target_layers < 1:
            raise ValueError(f"config.json num_hidden_layers={target_layers!r}: the target's layer count names "
                             "the MTP layer (model.layers.{num_hidden_layers})")
        hf = SimpleNamespace(**{**data, "architectures": [architecture], "num_hidden_layers": 1})
        return cls(layer=ModelConfig.from_hf(hf), target_num_layers=target_layers)

    def to_json_dict(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        hf = self.layer.to_hf().to_dict()
        return {**hf, "architectures": [self.layer.architecture + NEXTN_SUFFIX],
                "num_hidden_layers": self.target_num_layers, "num_nextn_predict_layers": 1,
                "torch_dtype": torch_dtype}


@dataclass
class _TargetParts:
    """What the head borrows from the target (a plain object: not registered as parameters,
    so the head's state dict holds its own weights only)."""
    norm: RMSNorm | None = None
    lm_head: torch.Tensor | None = None      # (vocab, hidden)


class MtpHead(nn.Module):
    def __init__(self, config: MtpHeadConfig, own_norm: bool = True, own_lm_head: bool = False,
                 own_embedding: bool = False, max_positions: int | None = None):
        super().__init__()
        layer, eps = config.layer, config.layer.rms_norm_eps
        self.config = config
        self.own_embedding = own_embedding     # else the target's, shared at share_target
        self.embed_tokens = nn.Embedding(layer.vocab_size, layer.hidden_size) if own_embedding else None
        self.enorm = RMSNorm(layer.hidden_size, eps)
        self.hnorm = RMSNorm(layer.hidden_size, eps)
        self.eh_proj = nn.Linear(2 * layer.hidden_size, layer.hidden_size, bias=False)
        self.layer = DecoderLayer(layer, 0)
        self.norm = RMSNorm(layer.hidden_size, eps) if own_norm else None
        self.lm_head = nn.Linear(layer.hidden_size, layer.vocab_size, bias=False) if own_lm_head else None
        self.rope = RotaryEmbedding(layer.head_dim, max_positions or layer.max_position_embeddings,
                                    layer.rope_theta, layer.rope_scaling)
        self.borrowed = _TargetParts()

    def share_embedding(self, weight: torch.Tensor) -> None:
        """Uses the target's token embedding (vocab, hidden), frozen."""
        self.embed_tokens = nn.Embedding.from_pretrained(weight, freeze=True)

    def share_target(self, target: DecoderLM) -> None:
        """Borrows what the checkpoint left out: the embedding, the head norm, the lm_head."""
        if self.embed_tokens is None:
            self.share_embedding(target.embed_tokens.weight)
        if self.norm is None:
            self.borrowed.norm = target.norm
        if self.lm_head is None:
            self.borrowed.lm_head = target.embed_tokens.weight if target.config.tie_word_embeddings \
                else target.lm_head.weight

    def project(self, target_states: torch.Tensor) -> torch.Tensor:
        """The layer reads the target's state as it is (its hnorm normalises it)."""
        return target_states

    def step(self, batch: ForwardBatch, backend: AttentionBackend, features: torch.Tensor) -> torch.Tensor:
        """One step for the batch's token rows: features (N, hidden), the target's states (or
        the head's own outputs, for later chain steps); returns (N, hidden), whose logits()
        are this step's draft. The layer's K/V go to layer 0 of the batch's pool."""
        if self.embed_tokens is None:
            raise ValueError("the MTP head has no token embedding: call share_target(target model) first")
        embeds = self.enorm(self.embed_tokens(batch.input_ids))
        x = self.eh_proj(torch.cat([embeds, self.hnorm(features.to(embeds.dtype))], dim=-1))
        out, residual = self.layer(x, None, batch, backend, self.rope)
        return out + residual

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab)."""
        norm = self.norm or self.borrowed.norm
        weight = self.lm_head.weight if self.lm_head is not None else self.borrowed.lm_head
        if norm is None or weight is None:
            raise ValueError("the MTP head has no head norm / lm_head: call share_target(target model) first")
        return F.linear(norm(hidden), weight)


class MtpChainModel:
    """An MTP head as a draft_chain.ChainModel (the head's rows read the token after their
    target state, as an EAGLE head's do); its state is the layer's output."""
    token_offset = 1
    draft_vocab = None      # the whole target vocabulary

    def __init__(self, head: MtpHead, backend: AttentionBackend):
        self.head, self.backend = head, backend

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None) -> torch.Tensor:
        return self.head.step(batch, self.backend, features)[batch.logits_indices]

    def draft_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.head.logits(state)
