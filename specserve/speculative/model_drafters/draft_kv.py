"""A drafter's own KV cache, per request: which draft-pool slot holds which row, and the
token whose K/V it holds.

A draft model caches the same sequence as the target, plus the drafts of the last chain.
After a verify step only the rows whose token was committed stay valid (the accepted
drafts; everything past the first mismatch is freed), so the next chain feeds only what is
missing. Nothing here runs a model: `DraftKVTable` only hands out, keeps and frees slots of
the drafter's own pool, through the same allocator interface as the target's.

Row r holds the request's token at position r + token_offset: 0 for a draft model (row =
position), 1 for an EAGLE head, whose row r reads the token after the target state of
position r. Rows reserved for chain drafts hold UNSET until recorded.

Rows of req_to_token: the draft pool's table has the target pool's shape, and a request
uses the row the scheduler gave it in the target pool. A request that was preempted (its
row freed) loses its draft cache and rebuilds it on resume, whatever row it then gets.

With the prefix cache on, an EAGLE head's first rows may be the tree's (kv/draft_rows.py):
a request starts with the rows of its cached prefix (`adopt`), and hands its own rows over
when they are cached (`share`). The tree's rows (`shared`) are never freed here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specserve.kv.pool import KVPool

if TYPE_CHECKING:
    from specserve.request.req import Req

UNSET = -1   # the token of a row reserved for a draft: matches no real token


@dataclass
class DraftSequence:
    row: int
    slots: list[int] = field(default_factory=list)    # draft-pool slot of rows 0..len-1
    tokens: list[int] = field(default_factory=list)   # the token whose K/V each slot holds
    committed: int = 0                                # rows known to hold the request's own tokens
    shared: int = 0                                   # rows 0 .. shared - 1 are the prefix cache's


class DraftKVTable:
    def __init__(self, pool: KVPool, token_offset: int = 0, row_fanout: int = 1):
        """row_fanout: table rows per request (a draft tree's beams: request row r owns rows
        r * fanout .. r * fanout + fanout - 1, each holding the cached rows)."""
        self.pool = pool
        self.token_offset = token_offset
        self.row_fanout = row_fanout
        self.sequences: dict[str, DraftSequence] = {}
        # (row, first position, slots) handed out since the last write_table
        self._new_entries: list[tuple[int, int, list[int]]] = []
        # requests whose cache holds rows past `committed` (a chain's drafts) until a sync
        # settles them: a plain step adds none, so its sync_batch does no per-request work
        self._unsettled: set[str] = set()

    def rows_of(self, req: "Req") -> int:
        """Rows a request's cache holds once every token it committed is in."""
        return req.num_tokens - self.token_offset

    def missing_rows(self, req: "Req") -> int:
        """Rows the request's cache lacks (a chain's accepted drafts count until a sync keeps
        them): what a proposal for it feeds first, in its catch-up forward."""
        seq = self.sequences.get(req.rid)
        held = seq.committed if seq is not None and seq.row == req.row else 0
        return max(self.rows_of(req) - held, 0)

    def cheapest_first(self, reqs: list["Req"]) -> list[int]:
        """Indices of `reqs`, fewest missing rows first (batch order among equals)."""
        return sorted(range(len(reqs)), key=lambda i: self.missing_rows(reqs[i]))

    def sync(self, req: "Req") -> DraftSequence:
        """The request's draft cache cut to the rows whose token the request committed
        (drafts the verify step rejected go back to the pool)."""
        seq = self.sequences.get(req.rid)
        if seq is not None and seq.row != req.row:   # resumed after a preemption nobody reported
            self.detach(req)
            seq = None
        if seq is None:
            seq = self.sequences[req.rid] = DraftSequence(row=req.row)
        keep, limit = seq.committed, min(len(seq.tokens), self.rows_of(req))
        prompt, output, offset = req.prompt_ids, req.output_ids, self.token_offset
        while keep < limit and seq.tokens[keep] == _token_at(prompt, output, keep + offset):
            keep += 1
        if keep < len(seq.slots):
            self.pool.slots.free(seq.slots[keep:])
            del seq.slots[keep:], seq.tokens[keep:]
        seq.committed = keep
        if len(seq.tokens) <= keep:
            self._unsettled.discard(req.rid)
        return seq

    def sync_batch(self, reqs: list["Req"]) -> None:
        """`sync` of every request whose cache may hold rows it did not commit. At 64
        requests a sync of each cost ~160 us of host time a plain step (a 2-core CPU; the
        0.5B's plain step at 64 is host-bound, ~1.5 ms)."""
        if not self._unsettled:
            return
        for req in reqs:
            if req.rid in self._unsettled:
                self.sync(req)

    def reserve(self, req: "Req", chain_rows: int, chain_table: bool = True, seq: DraftSequence | None = None
                ) -> int | None:
        """Slots for every row the request's cache lacks and `chain_rows` more for a chain's
        drafts; returns the first row that was missing (None: the pool is full, and the
        request goes without drafts this step). The table entries of the new slots are
        written by `write_table`; with chain_table=False, those of the chain rows are left to
        the step that fills them (a fused step writes them on the device: rows it does not
        fill hold UNSET and are freed by the next sync before anything reads them).
        seq: the request's sequence, synced by the caller this step (else synced here)."""
        seq = seq if seq is not None else self.sync(req)
        length = self.rows_of(req)
        end = length + chain_rows
        start = len(seq.slots)
        new = self.pool.slots.alloc(end - start)
        if new is None:
            return None
        seq.slots.extend(new)
        seq.tokens.extend(_tokens_at(req, start + self.token_offset, length + self.token_offset))
        seq.tokens.extend([UNSET] * (end - max(start, length)))
        seq.committed = length                      # rows < length now hold (or will hold) its tokens
        if end > length:
            self._unsettled.add(req.rid)
        table = new if chain_table else new[:max(length - start, 0)]
        if table:
            self._new_entries.append((seq.row, start, table))
        return start

    def append_reserved(self, req: "Req", slots: list[int]) -> None:
        """Rows after every committed one, whose slots (from this pool) a step launched
        before the request's last commit was read reserved: held as `reserve` would hold
        chain rows. The cache must hold every committed row (that step feeds the next)."""
        seq = self.sync(req)
        if len(seq.slots) != self.rows_of(req):
            raise RuntimeError(f"request {req.rid}: its draft cache holds {len(seq.slots)} rows, not its "
                               f"{self.rows_of(req)} committed ones, under a step launched after them")
        seq.slots.extend(slots)
        seq.tokens.extend([UNSET] * len(slots))
        self._unsettled.add(req.rid)

    def record_drafts(self, req: "Req", drafts: list[int]) -> None:
        """The chain fed these drafts in its reserved rows, in order (kept if accepted)."""
        seq = self.sequences[req.rid]
        start = self.rows_of(req)
        seq.tokens[start:start + len(drafts)] = drafts

    def truncate(self, req: "Req", rows: int) -> None:
        """Frees the request's rows from `rows` on (their K/V is not what the table says);
        the prefix cache's stay."""
        seq = self.sequences.get(req.rid)
        if seq is not None:
            rows = max(rows, seq.shared)
        if seq is not None and rows < len(seq.slots):
            self.pool.slots.free(seq.slots[rows:])
            del seq.slots[rows:], seq.tokens[rows:]
            seq.committed = min(seq.committed, rows)

    def release(self, req: "Req") -> None:
        """Frees the request's own rows; rows of its cached prefix stay its own until `detach`."""
        seq = self.sequences.get(req.rid)
        if seq is not None and seq.shared:
            self.truncate(req, seq.shared)
            self._unsettled.discard(req.rid)
        else:
            self.detach(req)

    def detach(self, req: "Req") -> None:
        """Forgets the request: its own rows are freed, the prefix cache's stay the cache's."""
        self._unsettled.discard(req.rid)
        seq = self.sequences.pop(req.rid, None)
        if seq is not None:
            self.pool.slots.free(seq.slots[seq.shared:])
            # table writes still queued for its row are not its successor's
            self._new_entries = [entry for entry in self._new_entries if entry[0] != seq.row]

    # --- rows the prefix cache holds (kv/draft_rows.py) ---
    def adopt(self, req: "Req", slots: list[int]) -> None:
        """The request starts with the cached rows 0 .. len(slots) - 1 (the tree's)."""
        self.detach(req)
        if not slots:
            return
        length = len(slots)
        seq = self.sequences[req.rid] = DraftSequence(row=req.row, slots=list(slots), committed=length, shared=length)
        seq.tokens = _tokens_at(req, self.token_offset, length + self.token_offset)
        self._new_entries.append((seq.row, 0, list(slots)))

    def held_rows(self, req: "Req", start: int, end: int) -> list[int]:
        """The slots of the request's rows start .. k - 1 (k <= end) that hold its own tokens,
        found without freeing anything (a step in flight may write the rows after them)."""
        seq = self.sequences.get(req.rid)
        if seq is None or seq.row != req.row or start < seq.shared:
            return []
        stop = min(end, len(seq.tokens))
        offset = self.token_offset
        if seq.tokens[start:stop] == _tokens_at(req, start + offset, stop + offset):   # the usual case, in C
            return seq.slots[start:stop]
        prompt, output = req.prompt_ids, req.output_ids
        held = start
        while held < stop and seq.tokens[held] == _token_at(prompt, output, held + offset):
            held += 1
        return seq.slots[start:held]

    def share(self, req: "Req", start: int, slots: list[int], cached: int) -> None:
        """Rows start .. start + len(slots) - 1 are the tree's, in `slots`: the first `cached`
        another request cached first, whose copies replace the request's own (freed; its table
        names the tree's), the others its own (a prompt's rows, cached as it is prefilled, are
        mostly these: no scan of them)."""
        seq = self.sequences[req.rid]
        end, theirs = start + len(slots), start + cached
        duplicates = [own for own, tree in zip(seq.slots[start:theirs], slots) if own != tree]
        if duplicates:
            if any(entry[0] == seq.row for entry in self._new_entries):
                self.write_table()   # the entries it replaces first: one write never names a position twice
            self.pool.slots.free(duplicates)
            seq.slots[start:theirs] = slots[:cached]
            self._new_entries.append((seq.row, start, list(slots[:cached])))
        seq.shared = end
        seq.committed = max(seq.committed, end)

    def cached_rows(self, req: "Req") -> list[int]:
        seq = self.sequences.get(req.rid)
        return [] if seq is None else seq.slots[:seq.shared]

    def own_slots(self) -> dict[str, list[int]]:
        return {rid: seq.slots[seq.shared:] for rid, seq in self.sequences.items()}

    def write_table(self) -> None:
        """One req_to_token write for every slot handed out since the last call."""
        rows, positions, slots = [], [], []
        for row, start, new in self._new_entries:
            for beam in range(row * self.row_fanout, (row + 1) * self.row_fanout):
                rows.extend([beam] * len(new))
                positions.extend(range(start, start + len(new)))
                slots.extend(new)
        if slots:
            self.pool.write_entries_async(rows, positions, slots)
        self._new_entries = []


def _token_at(prompt: list[int], output: list[int], position: int) -> int:
    return prompt[position] if position < len(prompt) else output[position - len(prompt)]


def _tokens_at(req: "Req", start: int, end: int) -> list[int]:
    """The request's tokens at positions start .. end-1, without building prompt + output."""
    prompt, output = req.prompt_ids, req.output_ids
    if start >= len(prompt):
        return output[start - len(prompt):end - len(prompt)]
    return prompt[start:end] + output[:max(end - len(prompt), 0)]
