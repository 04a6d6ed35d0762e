"""A plain decode step's argmax under its requests' grammars: each constrained request's mask
of the tokens allowed next, applied on the device to the step's logits.

The forward of a plain step does not depend on the mask, only its argmax does. So on the
overlap schedule (engine/overlap.py) a step of constrained requests is launched as any other,
before the previous step's tokens are read; once they are committed (each matcher advanced
past its token), the masks are filled on MaskFiller's threads while the device runs the
forward and the host goes on with the rest of the step (its commit's bookkeeping, the
outputs' publishing), and the masked argmax is queued behind the forward before anything
touches the matchers again (`MaskedArgmax.result`). The matchers' work is then hidden wherever
it takes less than a forward.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specserve.grammar.apply import apply_grammar_bitmask
from specserve.grammar.matcher import RequestGrammar, bitmask_words, fill_next_masks, start_next_masks


def next_token_bitmask(grammars: Sequence[RequestGrammar | None], vocab_size: int,
                       pinned: bool = False) -> torch.Tensor:
    """(bs, words) int32 on the host: the tokens each request's grammar allows next; every
    token for a request without one."""
    out = _unfilled(grammars, vocab_size, pinned)
    fill_next_masks(list(grammars), out)
    return out


class MaskedArgmax:
    """The argmax of logits (bs, vocab) over the tokens each grammar allows, its masks being
    filled on threads from its making until `result`: the matchers are not to be touched
    meanwhile."""

    def __init__(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]):
        self.logits = logits
        self.mask = _unfilled(grammars, logits.shape[-1], pinned=logits.is_cuda)
        self.filling = start_next_masks(list(grammars), self.mask)

    def wait(self) -> None:
        """Once the masks are filled: the matchers are free again."""
        self.filling.wait()

    def result(self) -> torch.Tensor:
        """(bs,) the masked argmax, queued on logits' device without waiting for it (the mask
        goes from pinned memory)."""
        self.wait()
        mask = self.mask.to(self.logits.device, non_blocking=True)
        return apply_grammar_bitmask(self.logits, mask).argmax(-1)


def masked_argmax(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
    """(bs,) the argmax of logits (bs, vocab) over the tokens each grammar allows, queued on
    logits' device without waiting for it."""
    return MaskedArgmax(logits, grammars).result()


def _unfilled(grammars: Sequence[RequestGrammar | None], vocab_size: int, pinned: bool) -> torch.Tensor:
    """The bitmask before its fill: every token allowed in the rows of requests without a
    grammar; the others are left as allocated, every word of them written by the fill
    (a -1 written over 1.2 MB at 64 requests on a 151k vocabulary first was wasted)."""
    out = torch.empty((len(grammars), bitmask_words(vocab_size)), dtype=torch.int32, pin_memory=pinned)
    free = [row for row, grammar in enumerate(grammars) if grammar is None]
    if free:
        out[free] = -1
    return out
