"""Drafters by algorithm name, imported lazily: a drafter's module (and what it loads, e.g.
the n-gram trie's C build or a draft model) is touched only when that algorithm is asked for.

The registry lives apart from drafter.py: every drafter imports the protocol from there,
so the protocol must not import them back."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.args import ServerArgs
    from specserve.runner.draft_runner import DraftModelRunner
    from specserve.speculative.drafter import Drafter

MODEL_DRAFTERS = ("STANDALONE",)   # algorithms that run a draft model (the builder loads it first)


def needs_draft_model(args: "ServerArgs") -> bool:
    return args.speculative in MODEL_DRAFTERS


def create_drafter(args: "ServerArgs", draft_runner: "DraftModelRunner | None" = None) -> "Drafter | None":
    """The drafter `args.speculative` names (None without speculation). Model drafters draft
    with `draft_runner`, which the builder makes from the loaded draft model."""
    name = args.speculative
    if name is None:
        return None
    if name == "NGRAM":
        from specserve.speculative.ngram import NgramDrafter
        return NgramDrafter.from_args(args)
    if name in MODEL_DRAFTERS:
        if draft_runner is None:
            raise ValueError(f"speculative_algorithm {name} drafts with a draft model: pass its DraftModelRunner")
        from specserve.speculative.standalone import StandaloneDrafter
        return StandaloneDrafter(draft_runner)
    raise NotImplementedError(f"speculative_algorithm {args.speculative_algorithm!r} is not implemented")
