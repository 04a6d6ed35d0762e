"""NgramConfig: the settings of the n-gram trie, shared by its compiled and pure-Python forms."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramConfig:
    capacity: int = 1_000_000  # max trie nodes, shared across requests
    min_match_window: int = 1  # shortest suffix of the context that may match
    max_match_window: int = 12  # longest suffix tried (clamped to max_trie_depth - 1)
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10  # also the length of each node's ranked child list
    max_trie_depth: int = 18  # longest n-gram inserted (SGLang's branch_length)
    match_type: str = "BFS"  # "BFS" or "PROB"
    evict_to: float = 0.9  # an eviction leaves at most evict_to * capacity nodes
    owner_priority: bool = True  # rank an owner's own continuations first

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.max_trie_depth < 2:
            raise ValueError("capacity must be >= 1 and max_trie_depth >= 2")
        if not 1 <= self.min_match_window <= self.max_match_window:
            raise ValueError("need 1 <= min_match_window <= max_match_window")
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError("need 1 <= min_bfs_breadth <= max_bfs_breadth")
        if self.match_type not in ("BFS", "PROB"):
            raise ValueError(f"match_type must be 'BFS' or 'PROB', got {self.match_type!r}")
        if not 0.0 <= self.evict_to < 1.0:
            raise ValueError("evict_to must be in [0, 1)")

    @property
    def max_window(self) -> int:
        """The longest suffix worth matching: a match needs a continuation inside the trie."""
        return min(self.max_match_window, self.max_trie_depth - 1)

    def breadth_table(self) -> list[list[int]]:
        """[match_length][level] -> children expanded per node. Wide after a short (weak)
        match, narrow after a long one (linear in the match length, as SGLang does), then
        ``first // level`` at deeper levels, never below min_bfs_breadth."""
        span = max(1, self.max_window - self.min_match_window)
        table = []
        for length in range(self.max_window + 1):
            frac = min(1.0, max(0.0, (length - self.min_match_window) / span))
            first = round(self.max_bfs_breadth - frac * (self.max_bfs_breadth - self.min_bfs_breadth))
            table.append([first] + [max(self.min_bfs_breadth, first // level)
                                    for level in range(1, self.max_trie_depth + 1)])
        return table
