"""AcceptanceEvidence: how many tokens a draft cut to t nodes is expected to commit, per
evidence class (or per request), learned from "shadow" walks of past proposals.

The drafter always proposes the full tree and only the verified part is cut, so what any
cut would have committed is known: a shadow follows the tokens the request commits over the
next steps down the full proposal. In greedy decoding the committed stream does not depend
on the drafts, so the counterfactual is exact. Probes (proposals made on plain steps and
never verified) are walked the same way.

Host cost matters here: on plain steps every request's committed tokens pass through
`observe_batch`, once per step for the batch: a step without any pending shadow returns at once,
one with a few (a probe's) looks the batch up in C (`filter`), and a shadow keeps
what its walk needs precomputed (children by (parent, token), the nodes that have children).
"""
from __future__ import annotations

from bisect import bisect_left

from specserve.speculative.tree import TreeProposal

ACCEPT_EMA = 0.3     # tokens per proposal change with the text


class _Shadow:
    """One past proposal being walked down by the tokens committed since."""
    __slots__ = ("children", "inner", "key", "node", "path")

    def __init__(self, children: dict[tuple[int, int], int], inner: set[int], key: int | None):
        self.children = children   # (parent node, token) -> node
        self.inner = inner         # nodes with at least one child: a walk may go on from them
        self.key = key             # the drafter's evidence class, if any
        self.node = 0              # deepest node matched so far
        self.path: list[int] = []  # matched nodes below the root, increasing


class AcceptanceEvidence:
    def __init__(self, tiers: list[int]):
        self.tiers = tiers
        self._prior = {t: float(t) for t in tiers}   # before any evidence: every draft node accepted
        self._expected: dict[str, dict[int, float]] = {}    # per request
        self._by_key: dict[int, dict[int, float]] = {}      # per evidence class
        self._shadows: dict[str, list[_Shadow]] = {}

    def expected_tokens(self, rid: str, tier: int, key: int | None = None) -> float:
        """Tokens a step at this tier is expected to commit for the request (given a draft
        of evidence class `key`, when the drafter gives classes)."""
        if key is not None:
            return self._by_key.get(key, self._prior)[tier]
        return self._expected.get(rid, self._prior)[tier]

    def record(self, rids: list[str], trees: TreeProposal, num_nodes: list[int],
               keys: list[int] | None = None) -> None:
        """Full proposals (before any cut, verified or probes), one shadow per real draft."""
        if max(num_nodes) <= 1:
            return   # nothing drafted: no array to read
        tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
        for row, (rid, count) in enumerate(zip(rids, num_nodes)):
            if count > 1:
                row_parents, row_tokens = parents[row], tokens[row]
                children = {(row_parents[i], row_tokens[i]): i for i in range(1, count)}
                shadow = _Shadow(children, set(row_parents[1:count]), keys[row] if keys else None)
                self._shadows.setdefault(rid, []).append(shadow)

    def observe_batch(self, rids: list[str], committed: list[list[int]]) -> None:
        """Walks every pending proposal of each request down the tokens it just committed
        (committed[i]: request rids[i]'s), in batch order: a resolved walk moves the shared
        prior and its class's estimate, so the order is part of the result."""
        shadows = self._shadows
        if not shadows:
            return   # most plain steps: no proposal pending, no look-up per request
        walking = list(filter(shadows.__contains__, rids))   # a probe's few requests
        if walking:
            committed_of = dict(zip(rids, committed))
            for rid in walking:
                self._walk_all(rid, shadows[rid], committed_of[rid])

    def _walk_all(self, rid: str, shadows: list[_Shadow], committed: list[int]) -> None:
        pending = []
        for shadow in shadows:
            if _walk(shadow, committed):
                pending.append(shadow)
            else:
                self._resolve(rid, shadow)
        if pending:
            self._shadows[rid] = pending
        else:
            del self._shadows[rid]

    def release(self, rid: str) -> None:
        self._shadows.pop(rid, None)
        self._expected.pop(rid, None)

    def _resolve(self, rid: str, shadow: _Shadow) -> None:
        """Tokens the proposal cut to t nodes would have committed: the accepted path runs
        through increasing node indices, so it is the matched nodes below t, plus the bonus."""
        # the estimate `expected_tokens` reads for such a proposal: its class's, else its request's
        if shadow.key is not None:
            expected = self._by_key.setdefault(shadow.key, dict(self._prior))
        else:
            expected = self._expected.setdefault(rid, dict(self._prior))
        prior, path = self._prior, shadow.path
        for t in self.tiers:
            tokens = 1.0 + bisect_left(path, t)
            expected[t] += ACCEPT_EMA * (tokens - expected[t])
            prior[t] += ACCEPT_EMA * ACCEPT_EMA * (tokens - prior[t])


def _walk(shadow: _Shadow, committed: list[int]) -> bool:
    """Follows committed tokens down the tree; False once the walk has ended."""
    for token in committed:
        child = shadow.children.get((shadow.node, token))
        if child is None:
            return False
        shadow.node = child
        shadow.path.append(child)
    return shadow.node in shadow.inner
