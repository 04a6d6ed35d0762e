"""engine/commit.py: the KV commit of accepted nodes as array operations, deferred
detokenizing (same text, in order, never lost), and, on a tiny engine with NGRAM drafting,
streamed text that adds up to the final text and equals plain decoding's."""
from __future__ import annotations

import numpy as np
import pytest

from specserve.engine.commit import DeferredText, StepOutcome, commit_accepted_kv, ends_within
from specserve.kv.pool import PADDING_SLOT
from specserve.sampling.sampler import SampledStep
from tests.spec_fixtures import make_tiny_directory, ngram_args, tiny_engine


class FakeReq:
    def __init__(self, rid: str, max_new_tokens: int = 100, stop_ids=frozenset()):
        self.rid, self.kv_slots, self.output_ids = rid, [], []
        self.max_new_tokens, self.stop_ids = max_new_tokens, frozenset(stop_ids)
        self.detokenizer = RecordingDetokenizer()


class RecordingDetokenizer:
    def __init__(self):
        self.added: list[int] = []

    def add(self, token: int) -> None:
        self.added.append(token)

    def add_many(self, tokens: list[int]) -> None:
        self.added.extend(tokens)


class FakeScheduler:
    def __init__(self):
        self.freed: list[int] = []
        self.table_writes = 0

    def free_slots(self, slots):
        self.freed.extend(slots)

    def append_kv(self, reqs, slot_lists, write_table=True):
        self.table_writes += write_table
        for req, kept in zip(reqs, slot_lists):
            req.kv_slots.extend(kept)


def test_accepted_slots_are_kept_in_path_order_and_the_rest_freed():
    reqs = [FakeReq("a"), FakeReq("b"), FakeReq("c")]
    # a: 4 nodes, path 0 -> 2 -> 3; b: 2 nodes, only the root; c: 1 node (padding after it)
    sampled = SampledStep(tokens=[[7, 8, 9], [5], [6]], accepted_nodes=[[0, 2, 3], [0], [0]],
                          logprobs=None, top_logprobs=None)
    outcome = StepOutcome.from_sampled(sampled, 4, table_written=False)
    np.testing.assert_array_equal(outcome.accepted, [[0, 2, 3, -1], [0, -1, -1, -1], [0, -1, -1, -1]])
    node_slots = np.array([[10, 11, 12, 13], [20, 21, PADDING_SLOT, PADDING_SLOT],
                           [30, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT]])
    scheduler = FakeScheduler()
    commit_accepted_kv(scheduler, reqs, outcome, node_slots, np.array([4, 2, 1]))
    assert [r.kv_slots for r in reqs] == [[10, 12, 13], [20], [30]]
    assert sorted(scheduler.freed) == [11, 21]
    assert scheduler.table_writes == 1
    assert outcome.hidden_rows(4) == [[0, 2, 3], [4], [8]]


def test_a_graph_outcome_wider_than_the_proposal_commits_the_same_slots():
    """A CUDA graph runs the step at its tier's width (16) for a proposal of 3 nodes: the
    outcome's paths are padded with -1 past the proposal (the GPU case that CPU steps,
    whose outcome has the proposal's width, did not reach)."""
    reqs = [FakeReq("a"), FakeReq("b")]
    sampled = SampledStep(tokens=[[7, 8], [5]], accepted_nodes=[[0, 2], [0]], logprobs=None, top_logprobs=None)
    outcome = StepOutcome.from_sampled(sampled, 16, table_written=True)
    assert outcome.accepted.shape == (2, 16)
    node_slots = np.array([[10, 11, 12], [20, 21, PADDING_SLOT]])
    scheduler = FakeScheduler()
    commit_accepted_kv(scheduler, reqs, outcome, node_slots, np.array([3, 2]))
    assert [r.kv_slots for r in reqs] == [[10, 12], [20]]
    assert sorted(scheduler.freed) == [11, 21]
    assert scheduler.table_writes == 0
    assert outcome.hidden_rows(3) == [[0, 2], [3]]   # rows of the proposal-wide hidden states


def test_deferred_text_keeps_each_request_in_order():
    text = DeferredText()
    a, b = FakeReq("a"), FakeReq("b")
    text.defer(a, [1, 2])
    text.defer(b, [9])
    text.defer(a, [3])
    assert a.detokenizer.added == [] and b.detokenizer.added == []
    text.drain(a)
    assert a.detokenizer.added == [1, 2, 3] and b.detokenizer.added == []
    text.defer(a, [4])
    text.run()
    assert a.detokenizer.added == [1, 2, 3, 4] and b.detokenizer.added == [9]
    text.run()   # nothing twice
    assert a.detokenizer.added == [1, 2, 3, 4]


def test_ends_within_sees_stop_ids_and_length():
    req = FakeReq("a", max_new_tokens=5, stop_ids={2})
    req.output_ids = [7, 7]
    assert not ends_within(req, [5, 6])
    assert ends_within(req, [5, 6, 8])    # the fifth token
    assert ends_within(req, [5, 2])       # a stop token


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-commit")
    make_tiny_directory(path, "llama", seed=3)
    return path


REPEATING = [5, 6, 7, 8, 9, 10, 11, 12] * 6   # the trie has continuations: drafts get verified


def test_streamed_text_adds_up_and_equals_plain(tiny_path):
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    with tiny_engine(tiny_path) as plain:
        expected = plain.generate(input_ids=REPEATING, sampling_params=params)
    with tiny_engine(tiny_path, **ngram_args(8)) as engine:
        chunks = list(engine.generate(input_ids=REPEATING, sampling_params=params, stream=True))
        whole = engine.generate(input_ids=REPEATING, sampling_params=params)
    assert chunks[-1]["meta_info"]["spec_verify_ct"] < 40   # drafting steps ran, several tokens each
    assert sum((c["output_ids"] for c in chunks), []) == expected["output_ids"] == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == expected["text"] == whole["text"]


def _split_by_rows(outcome, node_slots, num_nodes):
    """The KV commit's split, request by request: the reference split_slots must equal."""
    kept, rejected = [], []
    for slots, path, k, count in zip(node_slots.tolist(), outcome.accepted.tolist(), outcome.accept_lens.tolist(),
                                     num_nodes.tolist()):
        path = path[:k]
        kept.append([slots[node] for node in path])
        rejected.extend([slots[node] for node in range(count) if node not in path])
    return kept, rejected


def test_the_array_split_equals_the_split_by_rows():
    """commit_accepted_kv's split keeps each path's slots in order and frees the rejected real
    nodes' ones, for random trees, accepted paths and outcomes wider than the proposal."""
    from specserve.engine.commit import split_slots
    rng = np.random.default_rng(0)
    for _ in range(200):
        bs, n = int(rng.integers(1, 12)), int(rng.integers(1, 9))
        width = n + int(rng.integers(0, 5))
        num_nodes = rng.integers(1, n + 1, size=bs)
        accepted = np.full((bs, width), -1, dtype=np.int64)
        lens = np.zeros(bs, dtype=np.int64)
        for row, count in enumerate(num_nodes):
            depth = int(rng.integers(1, count + 1))   # the root, then increasing nodes
            path = [0] + sorted(rng.choice(np.arange(1, count), size=depth - 1, replace=False).tolist())
            accepted[row, :depth], lens[row] = path, depth
        node_slots = np.where(np.arange(n) < num_nodes[:, None], rng.permutation(bs * n).reshape(bs, n) + 100,
                              PADDING_SLOT)
        outcome = StepOutcome([[0] * k for k in lens], accepted, lens, True)
        kept, rejected = _split_by_rows(outcome, node_slots, num_nodes)
        kept_arrays, rejected_arrays = split_slots(outcome, node_slots, num_nodes)
        assert kept == kept_arrays and sorted(rejected) == sorted(rejected_arrays)
        assert [len(k) for k in kept] == lens.tolist()
        assert len(rejected) == int((num_nodes - lens).sum())
