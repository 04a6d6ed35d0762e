"""Lossless verification of draft trees against the target's logits at every node.

`logits[b, i]` are the target's logits for the token that follows node i (its context is
the prefix, then the path root -> i). A step commits the accepted path's tokens (nodes at
depth 1..k-1) and one bonus token drawn at the last accepted node, so it commits
`accept_lens` = k >= 1 tokens.

Greedy: the committed tokens are exactly the target's argmax chain. Sampling: they are an
exact sample of the target's (filtered) distribution, whatever the drafts. Two rules:
- coupled (the default): greedy verification over the tokens the plain sampler would draw
  at each node's position, so a seeded request gets the same tokens with and without
  speculation, at any draft size (`_verify_coupled`);
- residual rejection (`_verify_rejection`), for drafts drawn from a distribution q.
Random numbers are keyed by (seed, position of the token being decided, salt, index), see
specserve/verify/random.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.verify.filters import apply_penalties, apply_sampling_filters
from specserve.verify.random import SALT_ACCEPT, SALT_TOKEN, exponential_race, uniform_at
from specserve.verify.tree import DraftTrees


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: torch.Tensor    # (bs, n) int64: the accepted path root first (node 0), -1 after
    accept_lens: torch.Tensor       # (bs,) int64: accepted nodes incl. the root = committed tokens, >= 1
    bonus_tokens: torch.Tensor      # (bs,) int64: drawn at the last accepted node
    committed_tokens: torch.Tensor  # (bs, n) int64: tokens of accepted nodes 1..k-1, the bonus, -1 after


def _result(trees: DraftTrees, on_path: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    """Lays out a verify outcome from the accepted path as a node set (bs, n) bool.

    The path has one node per depth 0..k-1, so a node's depth is its place in the path.
    """
    bs, n = on_path.shape
    node = torch.arange(n, device=on_path.device).expand(bs, n)
    accept_lens = on_path.sum(dim=1)
    # scatter path nodes to column `depth`; other nodes go to a scratch column n
    column = torch.where(on_path, trees.depth, n)
    accepted_nodes = torch.full((bs, n + 1), -1, dtype=torch.int64, device=on_path.device)
    accepted_nodes = accepted_nodes.scatter(1, column, node)[:, :n]
    path_tokens = trees.tokens.gather(1, accepted_nodes.clamp(min=0))           # (bs, n)
    after_root = torch.cat([path_tokens[:, 1:], path_tokens.new_full((bs, 1), -1)], dim=1)
    last = accept_lens.unsqueeze(1) - 1
    committed = torch.where(node < last, after_root, -1)
    committed = torch.where(node == last, bonus.unsqueeze(1), committed)
    return VerifyResult(accepted_nodes, accept_lens, bonus, committed)


def accept_matching_children(trees: DraftTrees, target: torch.Tensor) -> VerifyResult:
    """Accepts, from the root down, the first child whose token is `target` at its parent;
    target: (bs, n) the token the target model takes after each node. The target at the last
    accepted node is the bonus token.

    No loop: a node is on the accepted path iff it and all its non-root ancestors are the
    accepted child of their parent.
    """
    bs, n = trees.tokens.shape
    node = torch.arange(n, device=target.device).expand(bs, n)
    parent = trees.parents.clamp(min=0)
    is_child = trees.parents >= 0
    matches = is_child & (trees.tokens == target.gather(1, parent))
    # the accepted child of each node: the lowest-index matching child (n if none)
    candidate = torch.where(matches, node, n)
    accepted_child = torch.full_like(candidate, n).scatter_reduce(1, parent, candidate, "amin")
    accepted = matches & (accepted_child.gather(1, parent) == node)
    accepted[:, 0] = True
    # padding nodes see only themselves and are never accepted, so they drop out here
    on_path = ~(trees.ancestor_mask & ~accepted.unsqueeze(1)).any(dim=2)
    last = torch.where(on_path, trees.depth, -1).argmax(dim=1, keepdim=True)    # deepest path node
    return _result(trees, on_path, target.gather(1, last).squeeze(1))


def verify_greedy(trees: DraftTrees, logits: torch.Tensor) -> VerifyResult:
    """Accepts, from the root down, the first child whose token is the target's argmax.
    logits: (bs, n, V)."""
    return accept_matching_children(trees, logits.argmax(dim=-1))


SAMPLING_RULES = ("coupled", "rejection")


def verify_sampling(trees: DraftTrees, logits: torch.Tensor, temperatures: torch.Tensor,
                    top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                    seeds: torch.Tensor, positions: torch.Tensor,
                    draft_probs: torch.Tensor | None = None, *, rule: str = "coupled",
                    need_top_k_top_p: bool = True, need_min_p: bool = True,
                    max_top_k: int | None = None) -> VerifyResult:
    """Speculative sampling over a tree: the committed tokens follow the target exactly.

    logits: (bs, n, V); temperatures, top_ks, top_ps, min_ps, seeds: (bs,); positions:
    (bs,) the root's position (= prefix_len, tokens already in the KV cache).
    rule: "coupled" (the default: a seeded request gets the tokens plain decoding gives it,
    see _verify_coupled) or "rejection" (residual rejection sampling, see _verify_rejection;
    the rule for drafts drawn from a distribution q).
    draft_probs: rejection only. None for drafts that are a deterministic function of the
    context (n-gram tries, top-k trees); else (bs, n, V), the draft distribution q at node i
    from which the children of node i were drawn independently (with replacement).
    need_*, max_top_k: see apply_sampling_filters. Temperature-0 rows give verify_greedy's result.
    Either way the trees must not depend on this function's random numbers (drafters use
    SALT_DRAFT).
    """
    if rule not in SAMPLING_RULES:
        raise ValueError(f"rule must be one of {SAMPLING_RULES}, got {rule!r}")
    if rule == "coupled" and draft_probs is not None:
        raise ValueError("draft_probs: the coupled rule does not use a draft distribution; pass rule='rejection'")
    probs = apply_sampling_filters(logits, temperatures, top_ks, top_ps, min_ps,
                                   need_top_k_top_p=need_top_k_top_p, need_min_p=need_min_p, max_top_k=max_top_k)
    positions = positions.to(torch.int64)
    if rule == "coupled":
        return _verify_coupled(trees, probs, seeds, positions)
    return _verify_rejection(trees, probs, seeds, positions, draft_probs)


def plain_step_tokens(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                      min_ps: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *,
                      need_top_k_top_p: bool = True, need_min_p: bool = True,
                      max_top_k: int | None = None) -> torch.Tensor:
    """The token a plain decode step samples (bs,), from its logits (bs, V): verify_sampling's
    committed token for trees of a root alone, by either rule (both draw it as the race at the
    root's position + 1), without the trees' bookkeeping, ~35 device operations fewer. The same
    shapes as inside verify_sampling ((bs, 1, V)), so the same reductions and the same token."""
    probs = apply_sampling_filters(logits.unsqueeze(1), temperatures, top_ks, top_ps, min_ps,
                                   need_top_k_top_p=need_top_k_top_p, need_min_p=need_min_p, max_top_k=max_top_k)
    return exponential_race(probs, seeds, positions.to(torch.int64).unsqueeze(1) + 1, SALT_TOKEN)[:, 0]


def _verify_coupled(trees: DraftTrees, probs: torch.Tensor, seeds: torch.Tensor,
                    positions: torch.Tensor) -> VerifyResult:
    """Greedy verification over the tokens the plain sampler would draw.

    The plain sampler draws the token at position t as exponential_race(p, seed, t): a
    deterministic function of (seed, t, filtered probs). The token after node i is decided
    at position positions + depth_i + 1, with node i's probs: call it y_i. Accepting the
    child whose token is y_i at its parent, and committing y at the last accepted node, gives
    the tokens plain decoding would have committed, one by one: with the same seed the same
    text, whatever the drafts, the tree shape or the batch. Lossless: those tokens are a
    sample of the target when the seed is random (the race samples p exactly) and the drafts
    do not depend on the race's numbers.

    Acceptance equals residual rejection's for deterministic drafts: children x_1..x_k of a
    node are accepted with probability sum_j p(x_j) under both (here: y_i is one of them).
    """
    target = exponential_race(probs, seeds, trees.positions(positions) + 1, SALT_TOKEN)    # (bs, n)
    return accept_matching_children(trees, target)


def _accept(u: torch.Tensor, residual_x: torch.Tensor, residual_mass: torch.Tensor,
            draft_q_x: torch.Tensor | None) -> torch.Tensor:
    """The accept test of one child x, with u ~ U(0, 1) and r = residual / residual_mass.

    Without a draft distribution: accept with probability r(x).
    With one: accept with probability min(1, r(x) / q(x)), i.e. u * q(x) < r(x).
    """
    if draft_q_x is None:
        return u * residual_mass < residual_x
    return u * draft_q_x * residual_mass < residual_x


def _verify_rejection(trees: DraftTrees, probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                      draft_probs: torch.Tensor | None) -> VerifyResult:
    """Residual rejection sampling over a tree. probs: (bs, n, V) filtered.

    The math. At the current node let p be the target's (filtered) distribution; keep an
    unnormalised residual R (r = R / sum R), starting at R = p, and try the children
    x_1, x_2, ... in order:
    - deterministic drafts: accept x_j with probability r(x_j); on rejection set R(x_j) = 0.
      The first try outputs y = x_1 with probability r(y); else, with probability
      1 - r(x_1), the rest of the procedure runs on r' = r with x_1 removed and
      renormalised, which (by induction on the children left) outputs y with probability
      r'(y) = r(y) / (1 - r(x_1)) for y != x_1. Total: r(y) for every y.
    - drafts drawn from q: accept x_j with probability min(1, r(x_j) / q(x_j)); on rejection
      R <- max(R - q * sum R, 0), i.e. r <- norm(max(r - q, 0)). A try outputs y with
      probability q(y) min(1, r(y)/q(y)) = min(q(y), r(y)) and rejects with probability
      beta = 1 - sum_y min(q, r) = sum_y max(r - q, 0); the rest (independent draws from q,
      by induction) then outputs y with probability max(r(y) - q(y), 0) / beta. Total:
      min(q, r) + max(r - q, 0) = r(y) (SpecInfer's multi-draft rejection sampling).
    - no child accepted: draw the bonus token from r.
    So the token after the current node is an exact draw from p; if it is an accepted child
    the walk continues there with that child's p, which by the same argument gives the next
    token exactly, and so on: the committed sequence follows the target. Which numbers a
    step consumes depends on the drafts, so a seeded request's text depends on them too.

    Each try visits a distinct non-root node, so n - 1 rounds finish every row; a round
    tries one child per row, vectorised over the batch and the vocabulary.
    """
    bs, n, vocab = probs.shape
    device = probs.device
    flat_probs = probs.view(bs * n, vocab)
    row_start = torch.arange(bs, device=device) * n
    # One accept-test number per node, keyed by the position of the token it decides and
    # its rank among its siblings (= how many children of its parent were tried before it).
    u_nodes = uniform_at(seeds, trees.positions(positions), SALT_ACCEPT, _sibling_rank(trees))   # (bs, n)

    current = torch.zeros(bs, dtype=torch.int64, device=device)     # deepest accepted node
    child = trees.first_child[:, 0].clone()                         # next child to try, -1: none left
    residual = probs[:, 0].clone()                                  # (bs, V) unnormalised
    on_path = torch.zeros((bs, n + 1), dtype=torch.bool, device=device)   # column n: scratch
    on_path[:, 0] = True
    for _ in range(n - 1):
        has_child = child >= 0
        x_node = child.clamp(min=0).unsqueeze(1)                                    # (bs, 1)
        x = trees.tokens.gather(1, x_node)
        residual_x = residual.gather(1, x).squeeze(1)
        residual_mass = residual.sum(dim=1)
        u = u_nodes.gather(1, x_node).squeeze(1)
        if draft_probs is None:
            accept = has_child & _accept(u, residual_x, residual_mass, None)
            residual.scatter_(1, x, torch.where(accept | ~has_child, residual_x, 0.0).unsqueeze(1))
        else:
            q = draft_probs.reshape(bs * n, vocab).index_select(0, row_start + current).to(residual.dtype)
            q_x = q.gather(1, x).squeeze(1)
            accept = has_child & _accept(u, residual_x, residual_mass, q_x)
            shrunk = (residual - q * residual_mass.unsqueeze(1)).clamp_(min=0)
            # an all-zero remainder only comes from rounding when r == q (then rejection has
            # probability 0): keep the residual rather than divide by zero
            update = has_child & ~accept & (shrunk.sum(dim=1) > 0)
            residual = torch.where(update.unsqueeze(1), shrunk, residual)
        x_node = x_node.squeeze(1)
        residual = torch.where(accept.unsqueeze(1), flat_probs.index_select(0, row_start + x_node), residual)
        on_path.scatter_(1, torch.where(accept, x_node, n).unsqueeze(1), True)
        current = torch.where(accept, x_node, current)
        following = torch.where(accept, trees.first_child.gather(1, x_node.unsqueeze(1)).squeeze(1),
                                trees.next_sibling.gather(1, x_node.unsqueeze(1)).squeeze(1))
        child = torch.where(has_child, following, child)

    bonus_positions = positions + trees.depth.gather(1, current.unsqueeze(1)).squeeze(1) + 1
    bonus = exponential_race(residual, seeds, bonus_positions, SALT_TOKEN)
    return _result(trees, on_path[:, :n], bonus)


def _sibling_rank(trees: DraftTrees) -> torch.Tensor:
    """(bs, n): how many earlier children its parent has (0 for the root and padding)."""
    n = trees.num_slots
    node = torch.arange(n, device=trees.tokens.device)
    is_child = trees.parents >= 0
    earlier_sibling = ((trees.parents.unsqueeze(2) == trees.parents.unsqueeze(1))
                       & is_child.unsqueeze(1) & (node.view(1, 1, n) < node.view(1, n, 1)))   # (bs, i, j)
    return (earlier_sibling & is_child.unsqueeze(2)).sum(dim=2)


def apply_penalties_to_tree(logits: torch.Tensor, trees: DraftTrees, base_counts: torch.Tensor,
                            prompt_mask: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                            presence: torch.Tensor) -> torch.Tensor:
    """Penalties at every tree node, exactly as plain decoding would apply them.

    logits (bs, n, V); base_counts (bs, V) int: output-token counts of the committed tokens,
    the root included (it has been committed: it is the last sampled token); prompt_mask
    (bs, V) bool; repetition, frequency, presence (bs,). Logits at node i predict the token
    after node i, so their output history is the committed tokens plus the draft tokens of
    the path root -> i without the root: node i's own token and its non-root ancestors'.
    Padding nodes get the base counts. See filters.apply_penalties for the penalties.
    Plain decoding (root_only trees) gives the base counts: the same function serves both.
    """
    bs, n, _ = logits.shape
    node = torch.arange(n, device=logits.device)
    real = (node > 0) & (node < trees.num_nodes.unsqueeze(1))                  # (bs, n)
    history = (trees.ancestor_mask & real.unsqueeze(1)).float()                 # (bs, i, k): k in i's history
    # Every token gets the committed counts; then the (at most n) draft tokens of the tree are
    # recomputed at every node: extra[b, i, j] = how often node j's token is in node i's
    # history. Each such value is the full answer for that token, so duplicates agree.
    out = apply_penalties(logits, base_counts.unsqueeze(1), prompt_mask.unsqueeze(1), repetition, frequency, presence)
    same_token = (trees.tokens.unsqueeze(2) == trees.tokens.unsqueeze(1)).float()   # (bs, k, j)
    extra = torch.bmm(history, same_token).round().to(torch.int64)                   # (bs, i, j)
    token_of = trees.tokens.unsqueeze(1).expand(bs, n, n)                            # [b, i, j] = tokens[b, j]
    counts = base_counts.to(torch.int64).gather(1, trees.tokens).unsqueeze(1) + extra
    at_tokens = apply_penalties(logits.gather(2, token_of), counts,
                                prompt_mask.gather(1, trees.tokens).unsqueeze(1), repetition, frequency, presence)
    return out.scatter_(2, token_of, at_tokens)
