"""The draft model's KV cache, per request: which draft-pool slot holds which position, and
the token whose K/V it holds.

A draft model caches the same sequence as the target, plus the drafts of the last chain.
After a verify step only the positions whose fed token was committed stay valid (the
accepted drafts; everything past the first mismatch is freed), so the next chain feeds only
what is missing. Nothing here runs a model: `DraftKVTable` only hands out, keeps and frees
slots of the draft model's own pool, through the same allocator interface as the target's.

Rows: the draft pool's `req_to_token` has the target pool's shape, and a request uses the
row the scheduler gave it in the target pool. A request that was preempted (its row freed)
loses its draft cache and rebuilds it on resume, whatever row it then gets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.kv.pool import KVPool

if TYPE_CHECKING:
    from specserve.engine.request import Req

UNSET = -1   # the token of a slot reserved for a draft not drafted yet: matches no real token


@dataclass
class DraftSequence:
    row: int
    slots: list[int] = field(default_factory=list)    # draft-pool slot of positions 0..len-1
    tokens: list[int] = field(default_factory=list)   # the token whose K/V each slot holds
    committed: int = 0                                # positions known to hold the request's own tokens


@dataclass
class ChainSlots:
    """What a request's next draft chain feeds and where (see draft_chain.py)."""
    catch_up: range               # positions the draft model has not seen, fed before the chain
    chain_slots: list[int]        # slots of positions L-2 .. L+K-2 (L = the request's token count)


class DraftKVTable:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.sequences: dict[str, DraftSequence] = {}
        # (row, first position, slots) handed out since the last write_table
        self._new_entries: list[tuple[int, int, list[int]]] = []

    def sync(self, req: "Req") -> DraftSequence:
        """The request's draft cache cut to the positions whose token the request committed
        (drafts the verify step rejected go back to the pool)."""
        seq = self.sequences.get(req.rid)
        if seq is not None and seq.row != req.row:   # resumed after a preemption nobody reported
            self.release(req)
            seq = None
        if seq is None:
            seq = self.sequences[req.rid] = DraftSequence(row=req.row)
        keep, limit = seq.committed, min(len(seq.tokens), req.num_tokens)
        prompt, output = req.prompt_ids, req.output_ids
        while keep < limit and seq.tokens[keep] == (prompt[keep] if keep < len(prompt) else output[keep - len(prompt)]):
            keep += 1
        if keep < len(seq.slots):
            self.pool.slots.free(seq.slots[keep:])
            del seq.slots[keep:], seq.tokens[keep:]
        seq.committed = keep
        return seq

    def reserve_chain(self, req: "Req", num_steps: int) -> ChainSlots | None:
        """Slots for the catch-up and a chain of num_steps drafts (None: the pool is full;
        the request then goes without drafts this step). The table entries of new slots
        are written by `write_table`."""
        seq = self.sync(req)
        length = req.num_tokens
        end = length + num_steps - 1               # the chain's last fed position is end - 1
        start = len(seq.slots)
        new = self.pool.slots.alloc(end - start)
        if new is None:
            return None
        seq.slots.extend(new)
        seq.tokens.extend(_tokens_at(req, start, length))
        seq.tokens.extend([UNSET] * (end - max(start, length)))
        seq.committed = length                      # positions < length now hold (or will hold) its tokens
        self._new_entries.append((seq.row, start, new))
        return ChainSlots(range(start, max(start, length - 2)), seq.slots[length - 2:end])

    def record_drafts(self, req: "Req", drafts: list[int]) -> None:
        """The chain fed these drafts (d1 .. d_{K-1}) at positions L .. L+K-2."""
        seq = self.sequences[req.rid]
        start = req.num_tokens
        seq.tokens[start:start + len(drafts)] = drafts

    def release(self, req: "Req") -> None:
        seq = self.sequences.pop(req.rid, None)
        if seq is not None:
            self.pool.slots.free(seq.slots)

    def slots_held(self) -> int:
        return sum(len(seq.slots) for seq in self.sequences.values())

    def write_table(self) -> None:
        """One req_to_token write for every slot handed out since the last call."""
        rows, positions, slots = [], [], []
        for row, start, new in self._new_entries:
            rows.extend([row] * len(new))
            positions.extend(range(start, start + len(new)))
            slots.extend(new)
        if slots:
            self.pool.write_entries_async(rows, positions, slots)
        self._new_entries = []


def _tokens_at(req: "Req", start: int, end: int) -> list[int]:
    """The request's tokens at positions start .. end-1, without building prompt + output."""
    prompt, output = req.prompt_ids, req.output_ids
    if start >= len(prompt):
        return output[start - len(prompt):end - len(prompt)]
    return prompt[start:end] + output[:max(end - len(prompt), 0)]
