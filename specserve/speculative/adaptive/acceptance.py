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

from bisect import bisect_left, bisect_right, insort

from specserve.verify.tree import TreeProposal

ACCEPT_EMA = 0.3     # tokens per proposal change with the text


class Shadow:
    """One past proposal being walked down by the tokens committed since."""
    __slots__ = ("children", "ended", "inner", "key", "node", "path")

    def __init__(self, children: dict[tuple[int, int], int], inner: set[int], key: int | None):
        self.children = children   # (parent node, token) -> node
        self.inner = inner         # nodes with at least one child: a walk may go on from them
        self.key = key             # the drafter's evidence class, if any
        self.node = 0              # deepest node matched so far
        self.path: list[int] = []  # matched nodes below the root, increasing
        self.ended = False         # its walk is over: path is what it committed


class AcceptanceEvidence:
    def __init__(self, tiers: list[int]):
        self.tiers = tiers
        self._prior = {t: float(t) for t in tiers}   # before any evidence: every draft node accepted
        self._expected: dict[str, dict[int, float]] = {}    # per request
        self._by_key: dict[int, dict[int, float]] = {}      # per evidence class
        self._measured: list[int] = []                      # its keys, ascending
        self._shadows: dict[str, list[Shadow]] = {}

    def expected_tokens(self, rid: str, tier: int, key: int | None = None) -> float:
        """Tokens a step at this tier is expected to commit for the request (given a draft
        of evidence class `key`, when the drafter gives classes)."""
        if key is not None:
            return self._by_key.get(key, self._prior)[tier]
        return self._expected.get(rid, self._prior)[tier]

    def knows(self, key: int) -> bool:
        """Whether some walk of a proposal of evidence class `key` has ended (its estimate is
        measured, not the prior)."""
        return key in self._by_key

    def measured_at_most(self, key: int) -> int | None:
        """The largest measured class key <= `key` (None: none is)."""
        index = bisect_right(self._measured, key)
        return self._measured[index - 1] if index else None

    def record(self, rids: list[str], trees: TreeProposal, num_nodes: list[int],
               keys: list[int] | None = None) -> list[Shadow | None]:
        """Full proposals (before any cut, verified or probes), one shadow per real draft;
        returns each row's (None where nothing was drafted)."""
        if max(num_nodes) <= 1:
            return [None] * len(rids)   # nothing drafted: no array to read
        tokens, parents = trees.tokens.tolist(), trees.parents.tolist()
        recorded: list[Shadow | None] = []
        for row, (rid, count) in enumerate(zip(rids, num_nodes)):
            shadow = None
            if count > 1:
                row_parents, row_tokens = parents[row], tokens[row]
                children = {(row_parents[i], row_tokens[i]): i for i in range(1, count)}
                shadow = Shadow(children, set(row_parents[1:count]), keys[row] if keys else None)
                self._shadows.setdefault(rid, []).append(shadow)
            recorded.append(shadow)
        return recorded

    @property
    def walking(self) -> bool:
        """Whether any proposal waits for its walk (most plain steps: none)."""
        return bool(self._shadows)

    def observe_batch(self, rids: list[str], committed: list[list[int]]) -> None:
        """Walks every pending proposal of each request down the tokens it just committed
        (committed[i]: request rids[i]'s); the walks that ended this step are learned from
        together (`_learn`)."""
        shadows = self._shadows
        if not shadows:
            return   # most plain steps: no proposal pending, no look-up per request
        walking = list(filter(shadows.__contains__, rids))   # a probe's few requests
        if walking:
            committed_of = dict(zip(rids, committed))
            resolved = []
            for rid in walking:
                resolved += self._walk_all(rid, shadows[rid], committed_of[rid])
            if resolved:
                self._learn(resolved)

    def _walk_all(self, rid: str, shadows: list[Shadow], committed: list[int]) -> list[tuple[str, Shadow]]:
        """The request's walks that ended; the others stay pending."""
        pending, ended = [], []
        for shadow in shadows:
            (pending if _walk(shadow, committed) else ended).append(shadow)
        for shadow in ended:
            shadow.ended = True
        if pending:
            self._shadows[rid] = pending
        else:
            del self._shadows[rid]
        return [(rid, shadow) for shadow in ended]

    def release(self, rid: str) -> None:
        self._shadows.pop(rid, None)
        self._expected.pop(rid, None)

    def _learn(self, resolved: list[tuple[str, Shadow]]) -> None:
        """One step's ended walks move each estimate they belong to (`expected_tokens` reads
        a proposal's class's, else its request's) once, toward their mean. An update per walk
        let the last few walks of a batch decide a class's estimate (ACCEPT_EMA per walk: at
        64 requests the batch's last ~3): on an H100 (0.5B, code-types at 64) a drafting episode
        committed 5.6 tokens a request while its class expected 3.0, and the bucket went plain."""
        groups: dict[int, tuple[dict[int, float], list[list[int]]]] = {}
        for rid, shadow in resolved:
            if shadow.key is not None:
                expected = self._by_key.get(shadow.key)
                if expected is None:
                    expected = self._by_key[shadow.key] = dict(self._prior)
                    insort(self._measured, shadow.key)
            else:
                expected = self._expected.setdefault(rid, dict(self._prior))
            groups.setdefault(id(expected), (expected, []))[1].append(shadow.path)
        for expected, paths in groups.values():
            self._move(expected, paths, ACCEPT_EMA)
        self._move(self._prior, [shadow.path for _, shadow in resolved], ACCEPT_EMA * ACCEPT_EMA)

    def _move(self, estimate: dict[int, float], paths: list[list[int]], weight: float) -> None:
        """Toward the mean of what the walks' proposals, cut to t nodes, would have committed."""
        for t in self.tiers:
            mean = sum(committed_at(path, t) for path in paths) / len(paths)
            estimate[t] += weight * (mean - estimate[t])


def committed_at(path: list[int], tier: int) -> int:
    """What a walked proposal cut to `tier` nodes would have committed: the accepted path runs
    through increasing node indices, so the matched nodes below the tier, plus the bonus."""
    return 1 + bisect_left(path, tier)


def _walk(shadow: Shadow, committed: list[int]) -> bool:
    """Follows committed tokens down the tree; False once the walk has ended."""
    for token in committed:
        child = shadow.children.get((shadow.node, token))
        if child is None:
            return False
        shadow.node = child
        shadow.path.append(child)
    return shadow.node in shadow.inner
