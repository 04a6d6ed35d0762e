"""The EAGLE-3 heads of the peer benchmark: which head each model drafts with, and the view
of it that vLLM reads.

`peers run --eagle-head MODEL=DIR ...` names, per model, a head directory our trainer wrote
(`python -m specserve.train_eagle`: config.json for `LlamaForCausalLMEagle3` and
model.safetensors with fc, midlayer, norm, lm_head, d2t, t2d; no embedding, the target's is
shared). specserve and SGLang read that directory as it is. vLLM 0.26 reads the same weights
and architecture name, but not the same layer numbers: the ids in
`eagle_config.eagle_aux_hidden_state_layer_ids` count decoder layers whose *output* the head
fuses (SGLang adds 1 before capturing; so do we), while vLLM's V1 runner takes them as the
number of layers run before the capture, one layer early. A top-level
`eagle_aux_hidden_state_layer_ids` in vLLM's numbering comes first in both of its model
runners, so vLLM gets a view of the head: that config.json, links to the other files.
"""
from __future__ import annotations

import json
import os

from specserve.bench.peers_engines import EngineConfig


class HeadMissing(RuntimeError):
    """A drafting configuration has no usable drafter for the model (an EAGLE-3 head, or
    STANDALONE's draft model): its row says why."""


def parse_model_map(specs: list[str], flag: str, example: str) -> dict[str, str]:
    """`MODEL=VALUE` items (--eagle-head's MODEL=DIR, --draft-model's TARGET=DRAFT) ->
    {model: value}; ValueError naming `flag` on a malformed item."""
    values: dict[str, str] = {}
    for spec in specs:
        model, sep, value = spec.partition("=")
        if not sep or not model or not value:
            raise ValueError(f"{flag} {spec!r}: expected MODEL=VALUE, e.g. {example}")
        if model in values:
            raise ValueError(f"{flag} names {model!r} twice")
        if '"' in value or "\\" in value:   # a head's path goes into vLLM's JSON flag as it is
            raise ValueError(f"{flag} {spec!r}: may not contain quotes or backslashes")
        values[model] = value
    return values


def head_for_engine(config: EngineConfig, model: str, heads: dict[str, str], view_root: str) -> str | None:
    """The EAGLE-3 head directory `config` serves `model` with (None where it drafts without
    one); for vLLM, its view under `view_root`. HeadMissing when there is none to give."""
    if not config.needs_eagle_head:
        return None
    head = _head_directory(model, heads, "EAGLE-3", "--eagle-head")
    if config.engine == "vllm":
        return vllm_head_view(head, os.path.join(view_root, f"{model}-vllm"))
    return head


def eagle2_head_for_engine(config: EngineConfig, model: str, heads: dict[str, str]) -> str | None:
    """The EAGLE-2 head directory `config` serves `model` with (None where it needs none)."""
    return _head_directory(model, heads, "EAGLE-2", "--eagle2-head") if config.needs_eagle2_head else None


def _head_directory(model: str, heads: dict[str, str], kind: str, flag: str) -> str:
    head = heads.get(model)
    if head is None:
        named = ", ".join(sorted(heads)) or "none"
        raise HeadMissing(f"no {kind} head for {model}: pass {flag} {model}=DIR "
                          f"(a directory of python -m specserve.train_eagle; heads given for: {named})")
    if not os.path.isfile(os.path.join(head, "config.json")):
        raise HeadMissing(f"no {kind} head for {model}: {head} has no config.json")
    return head


def vllm_head_view(head: str, view_dir: str) -> str:
    """`view_dir`: the head's config.json with the fused layers in vLLM's numbering (the
    number of decoder layers run before each capture, SGLang's id + 1), every other file a
    link to the head's. A head without aux layers (EAGLE on the final state) is left as it is."""
    with open(os.path.join(head, "config.json")) as f:
        config = json.load(f)
    eagle = config.get("eagle_config") or {}
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not eagle.get("use_aux_hidden_state", True) or not layers:
        return head   # vLLM's defaults (2, N // 2, N - 3) are SGLang's and ours, in its numbering
    os.makedirs(view_dir, exist_ok=True)
    for name in os.listdir(head):
        link = os.path.join(view_dir, name)
        if name == "config.json":
            continue
        if os.path.lexists(link):   # a view of an earlier head: point it at this one
            os.remove(link)
        os.symlink(os.path.abspath(os.path.join(head, name)), link)
    with open(os.path.join(view_dir, "config.json"), "w") as f:
        json.dump({**config, "eagle_aux_hidden_state_layer_ids": [int(layer) + 1 for layer in layers]}, f, indent=2)
    return view_dir
