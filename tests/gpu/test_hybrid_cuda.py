"""Hybrid drafting (--speculative-hybrid-ngram) on a GPU (fp32) with a chain head: its head steps
are the fused chain's, replayed from the fused graphs and chained on the device, its trie steps
verified by the engine's graphs between them (speculative/hybrid/fused_hybrid.py). Greedy output
equals plain decoding, pinned and under the adaptive policy, with both sources drafting, and
seeded sampling gives plain decoding's tokens; every target and head slot comes back; trie steps
are forecast, the head still given their states (which a graph's next replay overwrites). The
random tiny target and head of tests/test_hybrid_drafting.py, choosing as before any step is priced
(its `unpriced_steps`, autouse here too: the choice under measured prices moves with wall times)."""
from __future__ import annotations

import pytest

from specserve.speculative.hybrid import source_choice
from specserve.speculative.hybrid.fused_hybrid import FusedHybridDrafter
from tests.fused_fixtures import FusedSpy
from tests.spec_fixtures import price_steps, tiny_engine
from tests.test_hybrid_drafting import (GREEDY, SEEDED, check_forecast_steps, hybrid_args, models,  # noqa: F401
                                        sources, two_turns, unpriced_steps, wait_until_everything_is_free)

CUDA = {"device": "cuda", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def plain_cuda(models):  # noqa: F811
    with tiny_engine(models[0], **CUDA) as engine:
        return {"greedy": [o["output_ids"] for o in two_turns(engine, GREEDY)],
                "seeded": [o["output_ids"] for o in two_turns(engine, SEEDED)]}


@pytest.mark.parametrize("adaptive", [False, True], ids=["pinned", "adaptive"])
def test_hybrid_greedy_output_is_plain_decodings_on_cuda(models, plain_cuda, adaptive, monkeypatch):  # noqa: F811
    """(The random head drafts seldom under the adaptive policy: there the trie's drafts are taken
    wherever they beat it, so that both sources draft in this short run.)"""
    if adaptive:
        monkeypatch.setattr(source_choice, "BREAK_GAIN", 0.0)
    target, head = models
    with tiny_engine(target, **CUDA, **hybrid_args(head, adaptive=adaptive)) as engine:
        if adaptive:   # priced from a fixed cost model: a GPU's tiny steps cost little beside the host's work,
            price_steps(engine, 0.010, 0.0001)   # and measured, the policy held the batch plain
        drafter = engine.core.drafter
        assert isinstance(drafter, FusedHybridDrafter) and drafter.head.fused.graphs is not None
        spy = FusedSpy(drafter.head)
        outputs = two_turns(engine, GREEDY)
        assert [o["output_ids"] for o in outputs] == plain_cuda["greedy"]
        used = sources(outputs)
        assert used.get("ngram", 0) > 0 and used.get("head", 0) > 0, used
        wait_until_everything_is_free(engine)
    assert spy.fused > 0 and spy.engine > 0, vars(spy)
    assert adaptive or spy.chained > 0, vars(spy)   # pinned: head steps chained on the device


def test_hybrid_seeded_sampling_is_plain_decodings_on_cuda(models, plain_cuda, monkeypatch):  # noqa: F811
    monkeypatch.setattr(source_choice, "BREAK_GAIN", 0.0)
    target, head = models
    with tiny_engine(target, **CUDA, **hybrid_args(head)) as engine:
        outputs = two_turns(engine, SEEDED)
        assert [o["output_ids"] for o in outputs] == plain_cuda["seeded"]
        assert len(sources(outputs)) == 2
        wait_until_everything_is_free(engine)


def test_hybrid_trie_steps_are_forecast_on_cuda(models, plain_cuda, monkeypatch):  # noqa: F811
    target, head = models
    with tiny_engine(target, **CUDA, **hybrid_args(head)) as engine:   # forecasts: on by default on a GPU
        assert engine.core.runner.graphs is not None
        check_forecast_steps(engine, plain_cuda["greedy"], monkeypatch, tolerance=1e-3)
