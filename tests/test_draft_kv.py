"""DraftKVTable: a chain's rows are settled by the next sync (rejected drafts back to the
pool); plain steps, which add no rows, cost sync_batch no per-request work."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.kv.pool import KVPool
from specserve.speculative.model_drafters.draft_kv import UNSET, DraftKVTable


@dataclass
class FakeReq:
    rid: str
    row: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


def make_table() -> DraftKVTable:
    return DraftKVTable(KVPool(1, 1, 8, 64, 4, 32, torch.float32, torch.device("cpu")), token_offset=1)


def test_sync_batch_frees_the_rejected_drafts_and_skips_plain_steps(monkeypatch):
    table = make_table()
    drafted, plain = FakeReq("a", 1, [5, 6, 7]), FakeReq("b", 2, [8, 9])
    free_at_start = table.pool.slots.available()
    assert table.reserve(drafted, 3) == 0 and table.reserve(plain, 0) == 0   # rows 0-1 fed; 3 chain rows for a
    table.record_drafts(drafted, [10, 11, 12])
    assert table.sequences["a"].tokens == [6, 7, 10, 11, 12]
    drafted.output_ids += [10, 13]           # the verify step accepted 10, then corrected 11 to 13
    table.sync_batch([drafted, plain])
    seq = table.sequences["a"]
    assert seq.tokens == [6, 7, 10] and seq.committed == 3 and len(seq.slots) == 3
    assert table.pool.slots.available() == free_at_start - 3 - 1

    synced = []
    monkeypatch.setattr(table, "sync", lambda req: synced.append(req.rid))
    for token in (20, 21, 22):                # plain steps: no chain rows anywhere
        drafted.output_ids.append(token)
        plain.output_ids.append(token)
        table.sync_batch([drafted, plain])
    assert synced == []
    monkeypatch.undo()

    assert table.reserve(plain, 2) is not None      # a chain again: its rows wait for the next sync
    assert table.sequences["b"].tokens[-2:] == [UNSET, UNSET]
    synced_rids = []
    original = table.sync
    monkeypatch.setattr(table, "sync", lambda req: synced_rids.append(req.rid) or original(req))
    plain.output_ids.append(30)
    table.sync_batch([drafted, plain])
    assert synced_rids == ["b"] and table.sequences["b"].tokens[-1] != UNSET


def test_release_forgets_unsettled_rows():
    table = make_table()
    req = FakeReq("a", 1, [5, 6, 7])
    free_at_start = table.pool.slots.available()
    table.reserve(req, 4)
    table.release(req)
    assert table.pool.slots.available() == free_at_start and not table._unsettled
