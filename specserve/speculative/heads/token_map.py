"""FR-Spec token maps: the frequent ("hot") target tokens an EAGLE head may draft.

FR-Spec (Zhao et al., 2025) notes that with a large vocabulary the draft head's lm_head is
most of a draft step's cost, while a few tens of thousands of tokens cover nearly all text.
Restricting the head's lm_head to them makes every draft step cheaper; verification is
unchanged, so output stays exact whatever the map holds (a token outside it is simply
never drafted).

The file is SGLang's `--speculative-token-map`: `torch.save` of the hot target token ids,
a list of ints (what `python -m specserve.build_token_map` writes, most frequent first) or
a 1-D integer tensor; SGLang reads it with `torch.load(weights_only=True)` and
`torch.tensor(...)`. Only membership matters here: the head keeps its draft ids ascending.

How a map meets a head (`apply_token_map`, through EagleHead.restrict_draft_vocab, the
head's own d2t mechanism):
- an EAGLE (EAGLE-2) head over the whole target vocabulary keeps the map's lm_head rows,
  SGLang's `hot_token_id` slicing;
- an EAGLE3 head has its own draft vocabulary (d2t). SGLang ignores the map for EAGLE3 with
  a warning; we intersect instead: the head keeps its draft tokens that the map holds. A
  head trained over the whole vocabulary (train_eagle --draft-vocab-size = the vocabulary)
  then gets FR-Spec's saving, and a head with a 32k vocabulary of its own only drops the
  tokens the map calls rare.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from specserve.errors import ArgumentError, one_line

if TYPE_CHECKING:
    from specserve.speculative.heads.eagle_head import EagleHead

logger = logging.getLogger("specserve")
FIELD = "speculative_token_map"


def read_token_map(path: str, vocab_size: int | None = None) -> torch.Tensor:
    """The map's ids (int64, in file order); checked against `vocab_size` when given. A bad
    file is an ArgumentError naming speculative_token_map."""
    where = f"{FIELD}={path!r}"
    if not os.path.isfile(path):
        raise ArgumentError(f"{where}: no such file")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip and torch errors alike: the file is not one
        raise ArgumentError(f"{where}: not a torch.save file ({type(error).__name__}: "
                            f"{one_line(error)[:160]})") from None
    ids = _as_ids(data)
    if ids is None:
        raise ArgumentError(f"{where} holds {_describe(data)}; expected a list or a 1-D integer tensor of "
                            "target token ids (SGLang's format)")
    if ids.numel() == 0:
        raise ArgumentError(f"{where} holds no token ids")
    if int(ids.min()) < 0:
        raise ArgumentError(f"{where}: token id {int(ids.min())} is negative")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise ArgumentError(f"{where}: token id {int(ids.max())} is out of the target's vocabulary of "
                            f"{vocab_size} tokens (a map made for another tokenizer?)")
    unique, counts = ids.unique(return_counts=True)
    if bool((counts > 1).any()):
        raise ArgumentError(f"{where}: token id {int(unique[counts > 1][0])} appears more than once")
    return ids


def _as_ids(data: Any) -> torch.Tensor | None:
    if isinstance(data, torch.Tensor):
        integer = not (data.is_floating_point() or data.is_complex() or data.dtype == torch.bool)
        return data.long() if integer and data.dim() == 1 else None
    if isinstance(data, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in data):
        return torch.tensor(data, dtype=torch.long)
    return None


def _describe(data: Any) -> str:
    if isinstance(data, torch.Tensor):
        return f"a {data.dim()}-D {str(data.dtype).removeprefix('torch.')} tensor"
    if isinstance(data, dict):
        return f"a dict with keys {sorted(map(str, data))[:4]}"
    return f"a {type(data).__name__}" + (" with non-integer items" if isinstance(data, (list, tuple)) else "")


def write_token_map(path: str, ids: Iterable[int]) -> None:
    """Writes SGLang's format: torch.save of a list of ints."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    torch.save([int(i) for i in ids], path)


def hot_token_ids(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> list[int]:
    """The `size` most frequent ids of `counts` (vocab,), most frequent first (ties and unseen
    ids: lower ids first), with every id of `always` taking the place of the least frequent."""
    vocab = counts.numel()
    forced = {int(i) for i in always}
    if not 0 < size <= vocab:
        raise ValueError(f"size must be in [1, {vocab}] (the vocabulary), got {size}")
    if len(forced) > size or any(not 0 <= i < vocab for i in forced):
        raise ValueError(f"the always-kept ids {sorted(forced)} must be at most {size} ids in [0, {vocab})")
    order = torch.sort(counts, descending=True, stable=True).indices.tolist()
    chosen = forced | set([i for i in order if i not in forced][:size - len(forced)])
    return [i for i in order if i in chosen]


def apply_token_map(head: "EagleHead", path: str) -> None:
    """Restricts the head's draft vocabulary to the map in `path` (see the module docstring)."""
    ids = read_token_map(path, head.config.vocab_size)
    before = head.config.draft_vocab_size
    try:
        head.restrict_draft_vocab(ids)
    except ValueError:
        raise ArgumentError(f"{FIELD}={path!r}: none of its {ids.numel()} token ids is in the {head.config.algorithm} "
                            f"head's draft vocabulary of {before} tokens") from None
    logger.info("token map %s: the head drafts %d of its %d tokens (the map holds %d)", path,
                head.config.draft_vocab_size, before, ids.numel())
