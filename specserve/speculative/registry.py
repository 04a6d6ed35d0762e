"""Drafters by algorithm name, imported lazily: a drafter's module (and what it loads, e.g.
the n-gram trie's C build or a draft model) is touched only when that algorithm is asked for.

The registry lives apart from drafter.py: every drafter imports the protocol from there,
so the protocol must not import them back."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.args import ServerArgs
    from specserve.speculative.drafter import Drafter


def create_drafter(args: "ServerArgs") -> "Drafter | None":
    """The drafter `args.speculative` names (None without speculation)."""
    name = args.speculative
    if name is None:
        return None
    if name == "NGRAM":
        from specserve.speculative.ngram import NgramDrafter
        return NgramDrafter.from_args(args)
    raise NotImplementedError(f"speculative_algorithm {args.speculative_algorithm!r} is not implemented")
