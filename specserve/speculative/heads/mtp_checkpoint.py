"""Reading and writing MTP heads (mtp_head.py) in the layout models ship them in.

DeepSeek-V3 keeps its MTP module as one more layer of the target checkpoint,
`model.layers.{N}.*` (N = num_hidden_layers): `enorm`, `hnorm`, `eh_proj`, the decoder
layer's usual weights, `shared_head.norm`, `shared_head.head` and an `embed_tokens` copy.
SGLang's scripts/export_deepseek_nextn.py copies those tensors, unrenamed, into a
directory of their own with the target's config.json (architectures
[DeepseekV3ForCausalLMNextN]); `--speculative-draft-model-path` points there. We read
that layout: config.json (the target's config, architectures [<arch>NextN] or the
target's own) and *.safetensors (sharded with an index, or not), of which only the
`model.layers.{N}.` tensors are read, so the path may also be a target directory that
ships its MTP layer inside. `shared_head.norm`, `shared_head.head` and `embed_tokens` may be
absent: the head then borrows the target's.

What is supported: a dense Llama / Qwen2 / Qwen3 decoder layer in the MTP module (the
target's family: our decoder). Not supported: DeepSeek-V3's own MTP layer (MLA attention,
MoE), Qwen3-Next's `mtp.*` module (zero-centred norms, a hybrid / MoE layer), and targets
whose checkpoint carries extra MTP tensors as our target (the target loader refuses
tensors its config does not name).
"""
from __future__ import annotations

import json
import os

import torch

from specserve.errors import ArgumentError
from specserve.model.config import ModelConfig
from specserve.model.llama import _fused_target   # HF name -> (fused parameter, row offset), the target's loader's
from specserve.speculative.heads.mtp_head import MtpHead, MtpHeadConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# the MTP module's own tensors (after the layer prefix) -> MtpHead's parameter names
_MODULE_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
                 "shared_head.norm.weight": "norm.weight", "shared_head.head.weight": "lm_head.weight",
                 "embed_tokens.weight": "embed_tokens.weight"}
_OPTIONAL = {"shared_head.norm.weight", "shared_head.head.weight", "embed_tokens.weight"}


def layer_prefix(config: MtpHeadConfig) -> str:
    return f"model.layers.{config.target_num_layers}."


def save_mtp_head(head: MtpHead, directory: str, dtype: torch.dtype | None = None) -> None:
    """config.json and model.safetensors in the NextN layout (q/k/v and gate/up unfused back
    to their checkpoint names); the target's borrowed parts are not written."""
    from safetensors.torch import save_file
    os.makedirs(directory, exist_ok=True)
    prefix, params = layer_prefix(head.config), dict(head.named_parameters())
    state = {prefix + name: params[ours] for name, ours in _MODULE_NAMES.items()
             if ours in params and (name != "embed_tokens.weight" or head.own_embedding)}
    for name, shape in _layer_shapes(head.config.layer).items():
        ours, offset = _layer_parameter(name, head.config.layer)
        state[prefix + name] = params[ours][offset:offset + shape[0]]
    float_dtype = dtype or head.eh_proj.weight.dtype
    state = {name: (t.to(float_dtype) if t.is_floating_point() else t).detach().contiguous().cpu()
             for name, t in state.items()}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(head.config.to_json_dict(str(float_dtype).removeprefix("torch.")), f, indent=2)
    save_file(state, os.path.join(directory, WEIGHTS_FILE))


def read_mtp_head(directory: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  max_positions: int | None = None) -> MtpHead:
    """The MTP head in `directory`; call share_target(target model) before drafting."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        config = MtpHeadConfig.from_json_dict(json.load(f))
    prefix = layer_prefix(config)
    tensors = _read_prefixed(directory, prefix)
    if not tensors:
        raise ValueError(f"{directory}: no {prefix}* tensors (the MTP layer of a {config.target_num_layers}-layer "
                         "target, NextN layout)")
    head = MtpHead(config, own_norm="shared_head.norm.weight" in tensors, own_lm_head="shared_head.head.weight" in tensors,
                   own_embedding="embed_tokens.weight" in tensors, max_positions=max_positions)
    head = head.to(device=device, dtype=dtype)
    _load_state(head, tensors)
    return head.eval().requires_grad_(False)


def load_mtp_head(path: str, target: ModelConfig, device: torch.device, dtype: torch.dtype,
                  max_positions: int) -> MtpHead:
    """read_mtp_head for the engine: the head must fit the target (ArgumentError naming the flag)."""
    field = "speculative_draft_model_path"
    try:
        head = read_mtp_head(path, device, dtype, max_positions)
    except (ValueError, OSError) as error:
        raise ArgumentError(f"{field}={path!r}: {error}") from error
    layer = head.config.layer
    if (layer.vocab_size, layer.hidden_size) != (target.vocab_size, target.hidden_size):
        raise ArgumentError(f"{field}: the MTP head is for a target of vocabulary {layer.vocab_size} and hidden size "
                            f"{layer.hidden_size}; this target has {target.vocab_size} and {target.hidden_size}")
    return head


def _layer_shapes(layer: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The decoder layer's checkpoint names (after the prefix) and shapes."""
    return {name.removeprefix("model.layers.0."): shape for name, shape in layer.parameter_shapes().items()
            if name.startswith("model.layers.0.")}


def _layer_parameter(name: str, layer: ModelConfig) -> tuple[str, int]:
    fused, offset = _fused_target(name, layer)
    return "layer." + fused, offset


def _read_prefixed(directory: str, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors named prefix* of the directory's safetensors files, the prefix removed."""
    from safetensors import safe_open
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({file for name, file in json.load(f)["weight_map"].items() if name.startswith(prefix)})
    else:
        files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    tensors = {}
    for file in files:
        with safe_open(os.path.join(directory, file), framework="pt", device="cpu") as weights:
            for name in weights.keys():
                if name.startswith(prefix):
                    tensors[name.removeprefix(prefix)] = weights.get_tensor(name)
    return tensors


@torch.no_grad()
def _load_state(head: MtpHead, tensors: dict[str, torch.Tensor]) -> None:
    """Copies the checkpoint's tensors in, fusing q/k/v and gate/up; every weight must be there."""
    params, layer = dict(head.named_parameters()), head.config.layer
    expected = {**{name: tuple(params[ours].shape) for name, ours in _MODULE_NAMES.items() if ours in params},
                **_layer_shapes(layer)}
    missing = sorted(set(expected) - set(tensors) - _OPTIONAL)
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(f"MTP checkpoint: missing {missing[:5]}, unexpected {unexpected[:5]} "
                         f"(a dense {layer.architecture} layer in the NextN layout was expected)")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"MTP checkpoint: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
        ours, offset = (_MODULE_NAMES[name], 0) if name in _MODULE_NAMES else _layer_parameter(name, layer)
        params[ours][offset:offset + tensor.shape[0]].copy_(tensor)
