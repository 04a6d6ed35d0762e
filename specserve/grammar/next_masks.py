"""A plain decode step's argmax under its requests' grammars: each constrained request's mask
of the tokens allowed next, applied on the device to the step's logits.

The forward of a plain step does not depend on the mask, only its argmax does. So on the
overlap schedule (engine/overlap.py) a step of constrained requests is launched as any other,
before the previous step's tokens are read; once they are committed (each matcher advanced
past its token), the host fills the masks while the device runs the forward, and queues
the masked argmax behind it, before the step after it is launched. The matchers' work is
then hidden wherever it takes less than a forward.
"""
from __future__ import annotations

from typing import Sequence

import torch

from specserve.grammar.apply import apply_grammar_bitmask
from specserve.grammar.matcher import RequestGrammar, bitmask_words, fill_next_masks


def next_token_bitmask(grammars: Sequence[RequestGrammar | None], vocab_size: int,
                       pinned: bool = False) -> torch.Tensor:
    """(bs, words) int32 on the host: the tokens each request's grammar allows next; every
    token for a request without one."""
    out = torch.full((len(grammars), bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pinned)
    fill_next_masks(list(grammars), out)
    return out


def masked_argmax(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> torch.Tensor:
    """(bs,) the argmax of logits (bs, vocab) over the tokens each grammar allows, queued on
    logits' device without waiting for it (the mask goes from pinned memory)."""
    mask = next_token_bitmask(grammars, logits.shape[-1], pinned=logits.is_cuda)
    return apply_grammar_bitmask(logits, mask.to(logits.device, non_blocking=True)).argmax(-1)
