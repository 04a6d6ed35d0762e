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


def test_write_table_names_every_slot_handed_out_in_each_beams_row():
    """Two requests' rows, one reserved in two parts, a tree's fanout of 2: every (beam row,
    position) names the slot handed out for it; nothing else is written."""
    table = DraftKVTable(KVPool(1, 1, 8, 64, 8, 32, torch.float32, torch.device("cpu")), token_offset=1, row_fanout=2)
    a, b = FakeReq("a", 1, [5, 6, 7, 8]), FakeReq("b", 3, [9, 10])
    table.reserve(a, 0)
    table.reserve(b, 2)
    a.output_ids += [11, 12]
    table.reserve(a, 1)
    table.write_table()
    written = table.pool.req_to_token
    for req in (a, b):
        seq = table.sequences[req.rid]
        for beam in (2 * req.row, 2 * req.row + 1):
            assert written[beam, :len(seq.slots)].tolist() == seq.slots
            assert not written[beam, len(seq.slots):].any()
    assert int((written != 0).sum()) == 2 * sum(len(seq.slots) for seq in table.sequences.values())
    table.write_table()   # nothing new: nothing written
    assert table._new_entries == []


def test_held_rows_stop_at_the_first_row_that_is_not_the_requests_token():
    table = make_table()
    req = FakeReq("a", 1, [5, 6, 7, 8, 9])
    table.reserve(req, 0)                       # rows 0-3 hold tokens 6, 7, 8, 9
    seq = table.sequences["a"]
    assert table.held_rows(req, 0, 4) == seq.slots[:4] and table.held_rows(req, 1, 3) == seq.slots[1:3]
    seq.tokens[2] = 99                          # row 2 holds another token (a draft the verify rejected)
    assert table.held_rows(req, 0, 4) == seq.slots[:2]
    assert table.held_rows(req, 0, 9) == seq.slots[:2]   # past the rows it has: as far as it holds
