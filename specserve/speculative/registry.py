"""Drafters by algorithm name, imported lazily: a drafter's module (and what it loads, e.g.
the n-gram trie's C build or a draft model) is touched only when that algorithm is asked for.

The registry lives apart from drafter.py: every drafter imports the protocol from there,
so the protocol must not import them back."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.args import ServerArgs
    from specserve.speculative.drafter import Drafter

# algorithms that run a draft model, an EAGLE head or an MTP layer: draft_setup.prepare_draft
# loads it before the target's runner and makes the drafter after it
MODEL_DRAFTERS = ("STANDALONE", "EAGLE", "EAGLE3", "NAIVE_EAGLE", "MTP")


def needs_draft_model(args: "ServerArgs") -> bool:
    return args.speculative in MODEL_DRAFTERS


def create_drafter(args: "ServerArgs", on_gpu: bool = False) -> "Drafter | None":
    """The model-free drafter `args.speculative` names (None without speculation); `on_gpu`:
    the engine runs on a GPU (some defaults differ)."""
    name = args.speculative
    if name is None:
        return None
    if name == "NGRAM":
        from specserve.speculative.ngram.drafter import NgramDrafter
        return NgramDrafter.from_args(args, on_gpu)
    if name in MODEL_DRAFTERS:
        raise ValueError(f"speculative_algorithm {name} drafts with a model: draft_setup.prepare_draft makes it")
    raise NotImplementedError(f"speculative_algorithm {args.speculative_algorithm!r} is not implemented")
