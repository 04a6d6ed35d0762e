"""A step's bookkeeping is done once for the batch (observe_batch, SpecStats.record_step) and
leaves the state that a call per request, in batch order, left: the same pending shadow
walks (the evidence learns from a step's ended walks together, whatever their order), the
same queued and flushed n-gram tokens (an auto-flush mid-batch included) and proposals, the
same accept-length stats."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from specserve.request.req import SpecStats
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.ngram import drafter as ngram
from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.drafter import NgramDrafter
from specserve.verify.tree import TreeProposal
from tests.test_spec_kv import fake_req

VOCAB = 4   # few tokens: committed streams often follow a proposal for a few steps


def evidence_state(adaptive: AdaptiveDraftLength) -> tuple:
    evidence = adaptive.evidence
    walks = {rid: [(s.key, s.node, list(s.path)) for s in shadows] for rid, shadows in evidence._shadows.items()}
    return evidence._prior, evidence._expected, evidence._by_key, walks


def random_proposals(rng: random.Random, rids: list[str]) -> tuple[TreeProposal, list[int], list[int] | None]:
    rows = []
    for _ in rids:
        size = rng.randrange(1, 9)
        rows.append(([rng.randrange(VOCAB) for _ in range(size)], [-1] + [rng.randrange(i) for i in range(1, size)]))
    keys = [rng.randrange(1, 7) for _ in rids] if rng.random() < 0.5 else None
    return TreeProposal.from_lists(rows), [len(tokens) for tokens, _ in rows], keys


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_walks_the_shadows_as_a_call_per_request_and_learns_whatever_its_order(seed):
    """Probes on some steps (shadows for a few requests), then steps with no shadow pending
    or with some: after every step the pending walks equal the per-request calls', and the
    estimates do not depend on the batch's order."""
    rng = random.Random(seed)
    batched, per_request, shuffled = (AdaptiveDraftLength([1, 2, 4, 8]) for _ in range(3))
    rids = [f"r{i}" for i in range(24)]
    for _ in range(200):
        if rng.random() < 0.2:
            probed = rng.sample(rids, rng.randrange(1, 6))
            proposal = random_proposals(rng, probed)
            for adaptive in (batched, per_request, shuffled):
                adaptive.record_proposals(probed, *proposal)
        step = rng.sample(rids, rng.randrange(1, len(rids)))
        committed = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))] for _ in step]
        batched.observe_batch(step, committed)
        for rid, tokens in zip(step, committed):
            per_request.observe(rid, tokens)
        order = list(range(len(step)))
        rng.shuffle(order)
        shuffled.observe_batch([step[i] for i in order], [committed[i] for i in order])
        assert evidence_state(batched)[3] == evidence_state(per_request)[3]
        prior, per_rid, per_key, _ = evidence_state(shuffled)
        assert prior == pytest.approx(batched.evidence._prior)
        for got, want in ((per_rid, batched.evidence._expected), (per_key, batched.evidence._by_key)):
            assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k]) for k in got)
    assert batched.evidence._by_key or batched.evidence._expected   # walks were resolved


def test_a_step_moves_a_class_toward_the_mean_of_its_walks():
    """64 proposals of one class end in one step, 60 of them accepted in full and the last 4
    at once: the class's estimate moves once toward their mean (an update per walk left it
    near the last few, H100 0.5B code-types at 64)."""
    adaptive = AdaptiveDraftLength([1, 8])
    rids = [f"r{i}" for i in range(64)]
    chain = ([9, 1, 2, 3, 4, 5, 6, 7], [-1, 0, 1, 2, 3, 4, 5, 6])
    adaptive.record_proposals(rids, TreeProposal.from_lists([chain] * 64), [8] * 64, [5] * 64)
    adaptive.observe_batch(rids, [[1, 2, 3, 4, 5, 6, 7, 8]] * 60 + [[0]] * 4)
    mean = (60 * 8 + 4 * 1) / 64
    assert adaptive.expected_tokens("", 8, 5) == pytest.approx(8 + 0.3 * (mean - 8))


def test_a_step_without_pending_shadows_looks_no_request_up():
    adaptive = AdaptiveDraftLength([1, 2, 4])

    class NoLookUps(list):
        def __iter__(self):
            raise AssertionError("walked the batch")
    adaptive.observe_batch(NoLookUps(["a", "b"]), NoLookUps([[1], [2]]))


def recording_flushes(drafter: NgramDrafter) -> list:
    """The jobs the drafter hands to its writer: (owner, tokens) pairs and released owners."""
    jobs, submit = [], drafter.writer.submit

    def record(job, inline=False):
        jobs.append((list(job.args[0]), list(job.args[1])))
        submit(job, inline)
    drafter.writer.submit = record
    return jobs


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_queues_and_flushes_as_a_call_per_request(seed, monkeypatch):
    """Batches whose tokens reach AUTO_FLUSH_TOKENS mid-batch: the same jobs, cut at the same
    request, the same queue afterwards, and the same proposals from the tries."""
    monkeypatch.setattr(ngram, "AUTO_FLUSH_TOKENS", 23)
    rng = random.Random(seed)
    config = NgramConfig(capacity=2000, max_bfs_breadth=3, max_trie_depth=6)
    batched, per_request = NgramDrafter(config, False, background=False), NgramDrafter(config, False, background=False)
    jobs = recording_flushes(batched), recording_flushes(per_request)
    reqs = [fake_req(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))]) for i in range(12)]
    for drafter in (batched, per_request):
        for req in reqs:
            drafter.add_prompt(req)
    for step in range(60):
        running = rng.sample(reqs, rng.randrange(1, len(reqs)))
        committed = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 5))] for _ in running]
        for req, tokens in zip(running, committed):
            req.output_ids.extend(tokens)
        batched.observe_batch(running, committed)
        for req, tokens in zip(running, committed):
            per_request.observe(req, tokens)
        assert (batched._pending, batched._observed) == (per_request._pending, per_request._observed)
        assert jobs[0] == jobs[1]
        if step % 10 == 9:
            assert propose(batched, reqs) == propose(per_request, reqs)
    assert len(jobs[0]) > 10


def propose(drafter: NgramDrafter, reqs) -> tuple:
    trees, num_nodes = drafter.propose(reqs, [8] * len(reqs))
    return trees.tokens.tolist(), trees.parents.tolist(), num_nodes, list(drafter.proposal_keys())


def test_a_request_s_accept_stats_count_its_unrecorded_plain_steps():
    """The prefill's first token, then recorded drafting steps and plain steps (not recorded: a
    token each) in any order, a stop cutting the last step short: the counts and histogram of
    a per-step record."""
    rng = random.Random(3)
    for _ in range(20):
        output: list[int] = []
        stats = SpecStats(output)
        assert (stats.verify_steps, stats.accepted_tokens, stats.accept_length_histogram) == (0, 0, {})
        output.append(0)              # the prefill's token: no verify step
        steps, tokens, histogram = 0, 0, {}
        for _ in range(rng.randrange(1, 40)):
            drafted = rng.random() < 0.4
            count = rng.randrange(1, 6) if drafted else 1
            if drafted:
                SpecStats.record_step([SimpleNamespace(spec=stats)], [[0] * count])
            output.extend([0] * count)
            steps, tokens, histogram[count] = steps + 1, tokens + count, histogram.get(count, 0) + 1
        if rng.random() < 0.5:       # a stop cuts a drafting step: the counts keep what it accepted
            SpecStats.record_step([SimpleNamespace(spec=stats)], [[0] * 5])
            output.extend([0] * 2)
            steps, tokens, histogram[5] = steps + 1, tokens + 5, histogram.get(5, 0) + 1
        assert (stats.verify_steps, stats.accepted_tokens, stats.accept_length_histogram) == (steps, tokens, histogram)
        assert stats.accept_length == (tokens / steps if steps else 0.0)
