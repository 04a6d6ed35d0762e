"""The draft vocabulary of an EAGLE head: the target tokens it can propose.

EAGLE-3 heads predict over a subset of the target vocabulary (SpecForge: the 32k most
frequent tokens of the training answers), which makes the head's lm_head, its largest
matrix, several times smaller; a token outside the subset is simply never drafted.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def most_frequent_tokens(token_lists: Iterable[list[int]], vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids of `token_lists` (ties and unseen ids: lower ids first),
    in ascending order, as the head's d2t map wants them."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        ids = torch.tensor(tokens, dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        counts += torch.bincount(ids, minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values
