"""The lab's replay of NGRAM drafts forecast before a step's outcome is read (lab/ngram_forecast.py,
through the engine's forecast_table): on an answer that repeats its prompt both ways draft
nearly every token, and the forecast finds its row; on an answer the trie has never seen
neither drafts, so every step is plain."""
from __future__ import annotations

from lab.ngram_forecast import StepCosts, accepted, replay

COSTS = StepCosts(plain_ms=1.0, verify_ms=1.2, host_ms=0.3)


def test_a_repeated_answer_is_drafted_both_ways_and_forecast_ahead():
    text = [(7 * i) % 50 + 10 for i in range(120)]
    after = replay([text], [text[:100]], 4, 2, False, COSTS)
    ahead = replay([text], [text[:100]], 4, 2, True, COSTS)
    assert after.tokens == ahead.tokens == 100
    assert after.tokens / after.steps > 4 and ahead.tokens / ahead.steps > 4
    assert ahead.forecast_hits > 0.8 * ahead.steps and after.forecast_calls == 0
    assert ahead.modelled_ms < after.modelled_ms   # the same steps, without the host time between them


def test_an_unseen_answer_is_decoded_on_plain_steps():
    prompt, answer = list(range(10, 40)), list(range(100, 130))
    for ahead in (False, True):
        result = replay([prompt], [answer], 4, 2, ahead, COSTS)
        assert result.steps == result.tokens == 30 and result.drafted == 0
        assert result.modelled_ms == 30 * COSTS.plain_ms


def test_a_chain_is_accepted_up_to_its_first_wrong_draft():
    assert accepted([5, 6, 9], [5, 6, 7, 8], 0) == 2
    assert accepted([7, 8, 9], [5, 6, 7, 8], 2) == 2
