"""Saving and loading EAGLE heads in the layout SGLang and SpecForge use.

A head directory holds config.json (eagle_config.py) and model.safetensors with
`fc.weight`, `midlayer.*` (q/k/v/o, gate/up/down, input_layernorm, hidden_norm,
post_attention_layernorm), `norm.weight`, `lm_head.weight` and the vocabulary maps `d2t`
(int64: draft id i is target id i + d2t[i]) and `t2d` (bool over the target vocabulary).
The embedding is left out: the head borrows the target's. Loading also takes what other
trainers write: a `model.` prefix on the names, an `embed_tokens.weight` of the head's own,
a pytorch_model.bin, and no d2t/t2d for a head over the whole target vocabulary. A head saved
with `fp8=True` (the form kept in the repository, fp8_rows.py) stores its matrices as float8
with per-row scales and config.json says so (`weight_format`); `convert_head` writes it back
as bf16 for engines that read only SGLang's plain layout.
"""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from specserve.speculative.heads.eagle_config import EagleHeadConfig
from specserve.speculative.heads.eagle_head import EagleHead
from specserve.speculative.heads.fp8_rows import dequantize_rows, quantize_rows

WEIGHT_FORMAT_KEY = "weight_format"
FP8_ROWS_FORMAT = "float8_e4m3 rows"

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_VOCAB_MAPS = ("d2t", "t2d")


def save_head(head: EagleHead, directory: str, dtype: torch.dtype | None = None, fp8: bool = False) -> None:
    """Writes config.json and model.safetensors; floating weights in `dtype` (default: as they
    are), or with `fp8` the matrices as float8 rows (read back in `dtype`, default bfloat16)."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    state = {}
    for name, tensor in head.state_dict().items():
        if name.startswith("embed_tokens."):
            continue
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.detach().contiguous().cpu()
    float_dtype = dtype or (torch.bfloat16 if fp8 else head.lm_head.weight.dtype)
    config = head.config.to_json_dict(str(float_dtype).removeprefix("torch."))
    if fp8:
        state = quantize_rows(state)
        config[WEIGHT_FORMAT_KEY] = FP8_ROWS_FORMAT
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    save_file(state, os.path.join(directory, WEIGHTS_FILE))


def convert_head(source: str, destination: str, dtype: torch.dtype = torch.bfloat16, fp8: bool = False) -> None:
    """Rewrites the head in `source` into `destination`: plain `dtype` weights, or float8 rows."""
    save_head(load_head(source), destination, dtype=dtype, fp8=fp8)


def load_head(directory: str, target_num_layers: int | None = None, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> EagleHead:
    """The head saved in `directory`. Call share_embedding(target embedding) before drafting
    unless the checkpoint carried its own embedding."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        config = EagleHeadConfig.from_json_dict(json.load(f), target_num_layers)
    head = EagleHead(config).to(device=device, dtype=dtype)
    load_head_state(head, read_weights(directory))
    return head


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    safetensors_path = os.path.join(directory, WEIGHTS_FILE)
    if os.path.isfile(safetensors_path):
        from safetensors.torch import load_file
        return dequantize_rows(load_file(safetensors_path))
    bin_path = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory} has neither {WEIGHTS_FILE} nor pytorch_model.bin")


@torch.no_grad()
def load_head_state(head: EagleHead, state: dict[str, torch.Tensor]) -> None:
    """Copies a SpecForge/SGLang-named state dict into `head`; every weight must be there."""
    state = {name.removeprefix("model."): tensor for name, tensor in state.items()}
    embedding = state.pop("embed_tokens.weight", None)
    if embedding is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embedding.to(head.lm_head.weight), freeze=True)
    if "d2t" not in state:
        state["d2t"] = _identity_d2t(head.config)
    if "t2d" not in state:  # SGLang reads only d2t; t2d follows from it
        state["t2d"] = torch.zeros(head.config.vocab_size, dtype=torch.bool)
        state["t2d"][state["d2t"] + torch.arange(state["d2t"].numel())] = True
    params = dict(head.named_parameters()) | {name: head.get_buffer(name) for name in _VOCAB_MAPS}
    params = {name: tensor for name, tensor in params.items() if not name.startswith("embed_tokens.")}
    unexpected = sorted(set(state) - set(params))
    missing = sorted(set(params) - set(state))
    if unexpected or missing:
        raise ValueError(f"EAGLE head checkpoint: unexpected weights {unexpected[:5]}, missing weights {missing[:5]}")
    for name, tensor in state.items():
        target = params[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"EAGLE head checkpoint: {name} has shape {tuple(tensor.shape)}, "
                             f"the config gives {tuple(target.shape)}")
        target.copy_(tensor)


def _identity_d2t(config: EagleHeadConfig) -> torch.Tensor:
    """A head without vocabulary maps drafts over the whole target vocabulary."""
    if config.draft_vocab_size != config.vocab_size:
        raise ValueError(f"EAGLE head checkpoint has no d2t, but draft_vocab_size={config.draft_vocab_size} "
                         f"differs from vocab_size={config.vocab_size}")
    return torch.zeros(config.draft_vocab_size, dtype=torch.long)
