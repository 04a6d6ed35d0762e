"""RequestGrammar: one request's grammar matcher, advanced with the tokens it commits, and
the bitmasks of the tokens the grammar allows next, at the root and at every draft node.

Bitmasks are xgrammar's: int32 words, bit j of word w allows token 32 * w + j.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class PathCheck(NamedTuple):
    allowed: int                 # the tokens the grammar takes, up to the first it forbids or its end
    ended: bool                  # the grammar has ended after them (its stop token among them)
    mask: torch.Tensor | None    # (1, words): what it allows instead of the next token, where it forbids that


class RequestGrammar:
    def __init__(self, compiled, vocab_size: int, stop_token_ids: frozenset[int] = frozenset()):
        import xgrammar
        self._matcher = xgrammar.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids   # the tokens that end the grammar (its end takes one)
        # tokens the matcher took before their commit (a greedy step's path, checked as the step
        # is read: greedy_paths.py), which the commit's accepts then only confirm; left over
        # only where the request ended within the step
        self._ahead: list[int] = []

    def accept(self, token: int) -> bool:
        """Advances the matcher past a token; False (and no move) if the grammar forbids it
        there, or has ended."""
        if self._ahead:
            if self._ahead[0] == token:
                del self._ahead[0]
                return True
            self._drop_ahead()
        return self._matcher.accept_token(token)

    def confirm_ahead(self, tokens: list[int]) -> bool:
        """Confirms `tokens` where they are what the matcher took ahead (check_path's `keep`) and
        none is a stop token, so none can end the grammar: the commit need not check them one by
        one. False, and nothing changed, otherwise."""
        count = len(tokens)
        if self._ahead[:count] != tokens or not self.stop_token_ids.isdisjoint(tokens):
            return False
        del self._ahead[:count]
        return True

    def take_one(self, token: int) -> bool:
        """check_path([token], keep=True) where the grammar allows the token: taken ahead, for the
        commit to confirm. False, the matcher as it was, where it does not (forbidden, or ended):
        check_path then says which, and what it allows instead."""
        if self._ahead:
            self._drop_ahead()
        if not self._matcher.accept_token(token):
            return False
        self._ahead = [token]
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last num_tokens accepts (a walk over drafts that were not committed)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def check_path(self, tokens: list[int], keep: bool = False) -> PathCheck:
        """How far the grammar follows `tokens` (a step's tokens, in order) from the matcher's
        state (PathCheck). The matcher is left as it was; with `keep`, where the grammar forbids
        none of them, past the ones it took, for the commit to confirm (accept)."""
        self._drop_ahead()
        accepted, mask = 0, None
        try:
            for token in tokens:
                if accepted and self._ended_after(tokens[accepted - 1]):
                    break
                if not self._matcher.accept_token(token):
                    if not self._matcher.is_terminated():   # forbidden, not ended: what it allows instead
                        mask = torch.empty((1, bitmask_words(self.vocab_size)), dtype=torch.int32)
                        self._matcher.fill_next_token_bitmask(mask, 0)
                    break
                accepted += 1
            check = PathCheck(accepted, self._ended_after(tokens[accepted - 1] if accepted else None), mask)
            if keep and mask is None:
                self._ahead, accepted = list(tokens[:accepted]), 0
            return check
        finally:
            self.rollback(accepted)

    def _ended_after(self, last: int | None) -> bool:
        """Whether the grammar has ended, `last` the token it took last (None: none of the path
        yet). A grammar ends on a stop token, so the matcher is asked only after one (or after
        any token where the stop tokens are not known): asked at every token, the question was
        two of a plain step's three matcher calls a request. One that had ended before the path
        has finished its request, which takes no step."""
        if last is not None and self.stop_token_ids and last not in self.stop_token_ids:
            return False
        return self._matcher.is_terminated()

    def take_ahead(self, tokens: list[int]) -> None:
        """Takes a step's tokens, all allowed (check_path said so), before their commit confirms them."""
        check = self.check_path(tokens, keep=True)
        assert check.mask is None, "take_ahead: a token outside the grammar"

    def _drop_ahead(self) -> None:
        self.rollback(len(self._ahead))
        self._ahead = []

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request ends here."""
        return not self._ahead and self._matcher.is_terminated()

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (a fixed key, a closing brace), in xgrammar's own
        tokenization of the forced text, which may differ from the model's: as drafts they
        are verified like any other."""
        return self._matcher.find_jump_forward_tokens()

    def fill_tree(self, tokens: np.ndarray, first_child: np.ndarray, next_sibling: np.ndarray,
                  out: torch.Tensor) -> None:
        """out (n, words) int32: for each node of one draft tree (node 0 the root, the last
        committed token, already accepted), the tokens allowed after the path root -> node.
        A node whose own token the grammar forbids, and its subtree, get no allowed token;
        so does a node after which the grammar has ended. The matcher's state is unchanged
        (xgrammar walks the tree with accept and roll back)."""
        if len(tokens) == 1 or first_child[0] < 0:
            self._matcher.fill_next_token_bitmask(out, 0)
            out[1:] = 0
            return
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        self._matcher.traverse_draft_tree(as_tensor(first_child), as_tensor(next_sibling), as_tensor(tokens), out)
