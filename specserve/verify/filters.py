"""The target distribution of a sampling request: penalties, temperature, top-k, top-p, min-p.

Shared by the plain sampler and speculative verification, so that a token is drawn from
the same distribution with and without speculation. Everything is batched over rows, with
per-row parameters, and never syncs with the host.

Order (HF's): penalties on the logits -> temperature -> softmax -> top-k -> top-p on the
top-k-renormalised distribution -> min-p relative to the most likely token -> renormalise.
A row with temperature 0 is greedy: one-hot at argmax(logits) (ties: the lowest index, as
torch.argmax).
"""
from __future__ import annotations

import torch


def _per_row(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(bs,) -> (bs, 1, ..., 1) broadcastable against `like` (bs, ..., V)."""
    return param.view(-1, *([1] * (like.dim() - 1)))


def apply_sampling_filters(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor,
                           top_ps: torch.Tensor, min_ps: torch.Tensor, *,
                           need_top_k_top_p: bool = True, need_min_p: bool = True,
                           max_top_k: int | None = None) -> torch.Tensor:
    """Returns normalised probabilities, same shape as logits ((bs, V) or (bs, n, V)).

    temperatures, top_ps, min_ps: (bs,) float; top_ks: (bs,) int, <= 0 or >= V means no top-k.
    top_p >= 1 and min_p <= 0 disable those filters per row. Float32, or float64 for float64
    logits. need_top_k_top_p / need_min_p: the caller (who knows the batch's parameters on the
    host) may pass False when no row uses them, to skip the sort over the vocabulary.
    max_top_k: the caller may promise that every row has 0 < top_k <= max_top_k; then only the
    max_top_k likeliest tokens are ranked (a top-k selection instead of a sort over the
    vocabulary), with the same result.
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    temperatures = _per_row(temperatures.to(x.dtype), x)
    greedy = temperatures <= 0
    probs = torch.softmax(x / torch.where(greedy, torch.ones_like(temperatures), temperatures), dim=-1)
    # each filter a where against a scalar zero: a full pass over (rows, V) fewer than a zeros_like's
    if need_top_k_top_p:
        probs = torch.where(_top_k_top_p_keep(probs, top_ks, top_ps, max_top_k), probs, 0.0)

    if need_min_p:
        min_ps = _per_row(min_ps.to(x.dtype), x)
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps
        probs = torch.where(probs >= threshold, probs, 0.0)

    probs = probs / probs.sum(dim=-1, keepdim=True)
    # a greedy row: all zeros, then 1 added at its argmax (non-greedy rows add 0 there, exactly)
    probs = probs.masked_fill_(greedy, 0.0)
    ones = greedy.to(probs.dtype).expand(*probs.shape[:-1], 1)
    return probs.scatter_add_(-1, logits.argmax(dim=-1, keepdim=True), ones)


def _top_k_top_p_keep(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                      max_top_k: int | None) -> torch.Tensor:
    """The tokens top-k then top-p keep, a bool mask shaped like probs.

    Both keep a prefix of the tokens ranked by probability, ties by lowest id (a stable sort's
    order), so the decision needs only the ranked probabilities (the largest max_top_k of them,
    or all): the prefix length `count`. top-p keeps every token whose preceding mass is still
    below top_p of the top-k mass (the smallest prefix that reaches it). The mask is then rebuilt
    from values: every token above the smallest kept probability, and of the tokens equal to it
    the lowest ids the prefix holds. A handful of passes over (rows, V) besides the ranking: at
    64 rows of 151,936 tokens each pass costs ~30 us on an H100.
    """
    vocab = probs.shape[-1]
    selected = max_top_k is not None and max_top_k < vocab
    if selected:
        ranked, ids = probs.topk(max_top_k, dim=-1)                          # (..., max_top_k)
    else:
        ranked, ids = probs.sort(dim=-1, descending=True, stable=True)      # (..., V)
    top_ks = _per_row(top_ks.to(torch.int64), probs)
    top_ks = torch.where((top_ks <= 0) | (top_ks > vocab), vocab, top_ks)
    # greedy rows of a selection may ask for more than were ranked: their mask is not used
    top_ks = top_ks.clamp(max=ranked.shape[-1]).expand(*ranked.shape[:-1], 1)
    mass = prefix_mass(ranked)                                              # mass[r]: ranks 0..r
    top_ps = _per_row(top_ps.to(probs.dtype), probs)
    threshold = top_ps * mass.gather(-1, top_ks - 1)
    # rank r + 1 is kept while the mass of ranks 0..r is below the threshold; rank 0 always
    count = 1 + (mass[..., :-1] < threshold).sum(dim=-1, keepdim=True)
    count = torch.where(top_ps >= 1, top_ks, torch.minimum(count, top_ks))  # >= 1
    smallest_kept = ranked.gather(-1, count - 1)
    above, tied = probs > smallest_kept, probs == smallest_kept
    if selected:   # a selection leaves tied tokens in no set order: count them by id
        needed = count - above.sum(dim=-1, keepdim=True)
        return above | (tied & (prefix_mass(tied, torch.int32) <= needed))
    return above | (tied & (torch.arange(vocab, device=probs.device) <= ids.gather(-1, count - 1)))


# Ranks a prefix sum runs along before it moves to the next chunk. torch's scan along the last
# dimension walks a long row serially: over 151,936 ranks it took 0.19 ms at 8 rows on an H100, where
# chunks scanned side by side take 0.02-0.04. 512 is the size whose filters were fastest over 1-256
# rows there (128 lost at 64 rows and more, where torch's scan of many short rows slows down).
MASS_CHUNK = 512


def prefix_mass(ranked: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cumulative sums along the last dimension (in dtype: default ranked's), scanned within
    chunks of MASS_CHUNK and then across the chunks' totals. A prefix's sum depends only on the
    ranks up to it, so a top-k selection's prefix masses are the full sort's first ones."""
    length = ranked.shape[-1]
    padded = -(-length // MASS_CHUNK) * MASS_CHUNK
    if padded != length:
        ranked = torch.nn.functional.pad(ranked, (0, padded - length))
    within = ranked.unflatten(-1, (padded // MASS_CHUNK, MASS_CHUNK)).cumsum(dim=-1, dtype=dtype)
    totals = within[..., -1].cumsum(dim=-1)                                 # through each chunk
    before = torch.cat([torch.zeros_like(totals[..., :1]), totals[..., :-1]], dim=-1)
    return (within + before.unsqueeze(-1)).flatten(-2)[..., :length]


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Repetition / frequency / presence penalties on logits (bs, ..., V); returns float32
    (float64 for float64 logits).

    counts: output-token counts broadcastable to logits (int); prompt_mask: tokens present in
    the prompt, broadcastable to logits (bool); repetition, frequency, presence: (bs,).
    - repetition (HF / SGLang): a token seen in the prompt or the output gets logit / r if
      its logit is > 0, else logit * r;
    - frequency (OpenAI): logit -= f * count_in_output;
    - presence (OpenAI): logit -= p * (count_in_output > 0).
    """
    x = logits if logits.dtype == torch.float64 else logits.float()
    repetition = _per_row(repetition.to(x.dtype), x)
    frequency = _per_row(frequency.to(x.dtype), x)
    presence = _per_row(presence.to(x.dtype), x)
    seen_in_output = counts > 0
    seen = seen_in_output | prompt_mask
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts.to(x.dtype) - presence * seen_in_output.to(x.dtype)
