"""DraftCut: which requests of a drafting step verify their drafts, and how many nodes.

A verify step is ragged (runner/tree_step.py: forward_ragged): it runs only the nodes it
verifies, so its cost follows the nodes of the requests that draft. The adaptive policy
(adaptive.py) cuts every draft to a tier and, where a class of requests is not expected to
gain enough tokens for its nodes, cuts that class's drafts to their root alone. Classes
are the drafter's evidence classes (NGRAM: the matched suffix's length) or, without them,
each request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from specserve.speculative.acceptance import AcceptanceEvidence


@dataclass(frozen=True)
class DraftCut:
    tier: int                      # the most nodes a request's draft keeps (1: plain decoding)
    level: int                     # the level its step is priced at (AdaptiveDraftLength._level)
    tokens: float                  # the tokens the batch is expected to commit
    drafted: frozenset | None      # the classes whose drafts are verified; None: every class

    def drafts(self, cls: Hashable) -> bool:
        return self.drafted is None or cls in self.drafted


PLAIN = DraftCut(1, 1, 0.0, frozenset())


@dataclass(frozen=True)
class ClassPart:
    """What one class's drafts add to a step at a tier, over verifying their roots alone."""
    cls: Hashable
    gain: float    # expected committed tokens beyond one a request
    extra: int     # nodes beyond the root


class DraftClasses:
    """The requests with a draft (more than a root), grouped by class."""

    def __init__(self, rids: list[str], num_nodes: list[int], keys: list[int] | None):
        self.keys = keys is not None
        self.groups: dict[Hashable, list[tuple[str, int]]] = {}
        for i, (rid, n) in enumerate(zip(rids, num_nodes)):
            if n > 1:
                self.groups.setdefault(keys[i] if keys is not None else rid, []).append((rid, n))

    def at_tier(self, tier: int, evidence: AcceptanceEvidence) -> list[ClassPart]:
        """Each class's gain and extra nodes with its drafts cut to `tier` nodes."""
        parts = []
        for cls, members in self.groups.items():
            extra = sum(min(n, tier) for _, n in members) - len(members)
            if self.keys:   # a class's requests expect the same
                gain = len(members) * (evidence.expected_tokens("", tier, cls) - 1.0)
            else:
                gain = sum(evidence.expected_tokens(rid, tier) for rid, _ in members) - len(members)
            parts.append(ClassPart(cls, gain, extra))
        return parts
