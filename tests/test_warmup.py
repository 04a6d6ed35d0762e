"""The start-up warm-up (engine/warmup.py) run through a real engine's build (a tiny
random model): it reaches every phase (a full draft of each tier), and leaves the engine
exactly as it found it (same outputs, every KV slot and row free, the
drafter's trie and the adaptive state as new). A CPU engine has no plan of its own
(nothing compiles there), so these tests hand the builder a small one."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest

from spec_fixtures import make_tiny_directory, tiny_engine
from specserve.engine import warmup
from specserve.engine.warmup_plan import BatchShape, WarmupPlan
from specserve.speculative.ngram.drafter import NgramDrafter

# every phase, small: lengths on both sides of the chunk size (24), a batch with a long
# prompt, two tiers at two batch sizes, a prompt arriving while others decode, the variants
EVERY_PHASE = WarmupPlan(prompt_lengths=(1, 40), decode_batches=(BatchShape(1), BatchShape(3, 20)), tiers=(2, 4),
                         tier_batches=(BatchShape(1), BatchShape(2, 12)), late_prompt_length=30, new_tokens=3)
NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}


@contextlib.contextmanager
def planned_warmup(plan: WarmupPlan):
    """Engines built inside warm up with `plan`; yields the list their reports go to."""
    reports = []
    real = warmup.warm_up

    def recording(*args, **kwargs):
        reports.append(real(*args, **kwargs))
        return reports[-1]

    with mock.patch.object(warmup, "plan_warmup", lambda shape: plan), mock.patch.object(warmup, "warm_up", recording):
        yield reports


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-warmup")
    make_tiny_directory(path, vocab_size=256)
    return path


def _outputs(engine) -> list[list[int]]:
    """Greedy and seeded sampled outputs of a few prompts (not their verify step counts: the
    adaptive draft length chooses by measured step times)."""
    prompts = [[5, 9, 14, 3] * 6, list(range(40, 100)), [7] * 3]
    greedy = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16})
    sampled = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.9, "top_p": 0.9, "seed": 3,
                                                                    "max_new_tokens": 16})
    return [o["output_ids"] for o in greedy + sampled]


@contextlib.contextmanager
def recorded_draft_sizes():
    """Yields the list of each proposal's largest tree size (any NGRAM drafter's)."""
    sizes = []
    propose = NgramDrafter.propose

    def recording(self, reqs, max_nodes):
        proposal, num_nodes = propose(self, reqs, max_nodes)
        sizes.append(max(num_nodes))
        return proposal, num_nodes

    with mock.patch.object(NgramDrafter, "propose", recording):
        yield sizes


def test_warmup_runs_every_phase_and_leaves_the_engine_as_it_found_it(tiny_path):
    args = {**NGRAM, "chunked_prefill_size": 24, "max_total_tokens": 2048}
    cold = tiny_engine(tiny_path, **args)
    with planned_warmup(EVERY_PHASE) as reports, recorded_draft_sizes() as draft_sizes:
        warm = tiny_engine(tiny_path, **args)
    try:
        report = reports[0]
        assert report.steps >= 30 and "trees of 2/4 nodes" in report.summary()
        assert {2, 4} <= set(draft_sizes)  # a random model too: the groups replay the primer's prompt
        core, pool = warm.core, warm.core.runner.pool
        assert not core.has_work() and pool.slots.available() == pool.size
        assert pool.free_rows() == cold.core.runner.pool.free_rows()
        assert core.drafter.trie.num_nodes() == cold.core.drafter.trie.num_nodes()  # nothing of its prompts
        assert set(core.adaptive.steps_per_tier.values()) == {0} and core.stats.total_tokens == 0
        assert _outputs(warm) == _outputs(cold)
    finally:
        cold.shutdown()
        warm.shutdown()


def test_skip_server_warmup_skips_it(tiny_path):
    with planned_warmup(EVERY_PHASE) as reports:
        engine = tiny_engine(tiny_path, skip_server_warmup=True)
    engine.shutdown()
    assert reports == [None]
