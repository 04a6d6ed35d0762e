"""Constrained plain greedy steps on the overlap schedule run unmasked (engine/overlap.py,
grammar/next_masks.py): each step is launched on the previous step's unmasked argmax, no mask
filled before a launch; a token the grammar forbids is replaced by its masked argmax as the step
is read, its request's row of the step launched ahead on it is cut (its slot freed), and the
request joins the next launch at the token committed, the other rows' steps running on. The outputs are
those of the normal path, which masks every step's logits before its argmax (the sampler:
every grammar's mask filled and applied), token for token; requests without a grammar beside
them are untouched; every KV slot comes back."""
from __future__ import annotations

import json

from specserve.bench.prompts import SAMPLE_PROMPTS
from tests.test_kv_accounting import wait_until_all_kv_is_free
from tests.test_overlap import ahead, plain  # noqa: F401 (fixtures: a SmolLM2 engine, one overlapped)

GREEDY = {"temperature": 0}
# what a small chat model does not write of itself: most of its unmasked picks are forbidden
STRAYING = [dict(GREEDY, max_new_tokens=40, regex=r"[qxz]{3,6}-[0-9]{4}-(kw|vj)[a-f]{2,5}"),
            dict(GREEDY, max_new_tokens=40, ebnf='root ::= "<" ("zq" | "xv")+ ">" [0-9] [0-9] "!"'),
            dict(GREEDY, max_new_tokens=40, json_schema=json.dumps(
                {"type": "object", "properties": {"zzq": {"type": "array", "items": {"type": "boolean"},
                                                          "minItems": 2, "maxItems": 4}},
                 "required": ["zzq"]}))]
FOLLOWED = [dict(GREEDY, max_new_tokens=40, json_schema=json.dumps(
                {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                 "required": ["name"]})),
            dict(GREEDY, max_new_tokens=30, regex=r"(yes|no), because [a-z ]{3,20}\.")]


def test_straying_requests_equal_the_masked_path_and_relaunch(plain, ahead):
    prompts = SAMPLE_PROMPTS[:len(STRAYING)]
    expected = plain.generate(prompts, STRAYING)
    before, used = ahead.core.overlap.relaunches, ahead.used["ahead"]
    got = ahead.generate(prompts, STRAYING)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    relaunches = ahead.core.overlap.relaunches - before
    print(f"rows cut and relaunched: {relaunches}; steps read from a launch ahead: {ahead.used['ahead'] - used}")
    assert relaunches >= 10                            # the cut-and-relaunch path ran many times
    assert ahead.used["ahead"] - used > 15             # while the others' steps ran on ahead
    assert [o["meta_info"]["finish_reason"]["type"] for o in got[:2]] == ["stop", "stop"]   # ran to their ends
    assert [o["meta_info"]["finish_reason"] for o in got] == [o["meta_info"]["finish_reason"] for o in expected]
    one = ahead.generate(prompts[0], STRAYING[0])      # batch 1: every stray relaunches the only row
    assert one["output_ids"] == expected[0]["output_ids"]
    wait_until_all_kv_is_free(ahead)


def test_requests_without_a_grammar_are_untouched(ahead):
    free = [dict(GREEDY, max_new_tokens=24), dict(GREEDY, max_new_tokens=33, ignore_eos=True)]
    free_prompts = SAMPLE_PROMPTS[3:5]
    alone = ahead.generate(free_prompts, free)
    before = ahead.core.overlap.relaunches
    mixed = ahead.generate(SAMPLE_PROMPTS[:3] + free_prompts, STRAYING + free)
    assert ahead.core.overlap.relaunches > before      # their steps were dropped and launched again too
    assert [o["output_ids"] for o in mixed[3:]] == [o["output_ids"] for o in alone]
    wait_until_all_kv_is_free(ahead)


def test_no_mask_is_filled_before_a_launch(plain, ahead, monkeypatch):
    """Masks are filled only as a step is read, one for each token a grammar forbids: never
    between reading a step and launching the next, and none for a step whose tokens are all
    allowed (the step's logits are not read either)."""
    import xgrammar

    from specserve.engine import overlap as overlap_module
    from specserve.engine.plain_step import PlainStep
    phase, fills, changed = {"now": None}, {"launch": 0, "read": 0}, []
    fill = xgrammar.GrammarMatcher.fill_next_token_bitmask

    def counting_fill(self, *args, **kw):
        if phase["now"] is not None:
            fills[phase["now"]] += 1
        return fill(self, *args, **kw)

    def within(name, method):
        def run(*args, **kw):
            phase["now"] = name
            try:
                return method(*args, **kw)
            finally:
                phase["now"] = None
        return run

    keep = overlap_module.keep_plain_to_grammar
    monkeypatch.setattr(overlap_module, "keep_plain_to_grammar",
                        lambda *args: changed.append(len(rows := keep(*args))) or rows)
    monkeypatch.setattr(xgrammar.GrammarMatcher, "fill_next_token_bitmask", counting_fill)
    monkeypatch.setattr(PlainStep, "launch", within("launch", PlainStep.launch))
    monkeypatch.setattr(PlainStep, "read", within("read", PlainStep.read))
    prompts = [SAMPLE_PROMPTS[i % 6] for i in range(6)]
    params = [FOLLOWED[i % 2] for i in range(4)] + STRAYING[:2]
    expected = plain.generate(prompts, params)
    used = ahead.used["ahead"]
    got = ahead.generate(prompts, params)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in expected]
    assert ahead.used["ahead"] - used > 15
    assert fills["launch"] == 0
    assert fills["read"] == sum(changed) > 0
    assert changed.count(0) > 5                        # steps with every token allowed: no mask
    wait_until_all_kv_is_free(ahead)


def test_a_benchmark_run_reports_its_grammar_relaunches(ahead):
    """RunWatch (the GPU suite's per-run record) counts the rows a grammar sent back in its run
    only: how often a real model's unmasked pick strays is what the H200 rows must show."""
    from specserve.bench.run_watch import RunWatch

    prompts = SAMPLE_PROMPTS[:len(STRAYING)]
    watch = RunWatch(ahead)
    try:
        ahead.generate(prompts, STRAYING)                  # before the reset: not this run's
        watch.reset()
        before = ahead.core.overlap.relaunches
        ahead.generate(prompts, STRAYING)
        summary = watch.summary()
    finally:
        watch.close()
    assert summary["grammar_relaunches"] == ahead.core.overlap.relaunches - before > 0
    wait_until_all_kv_is_free(ahead)


def test_a_prefills_first_token_is_its_masked_argmax_from_one_mask_a_request(plain, monkeypatch):
    """A greedy prefill's first token under a grammar (Sampler.first_tokens) is the sampler's
    masked pick (what a request asking for logprobs gets, which takes the full path): the model's
    own first token where the grammar allows it, another where it forbids it, from one mask
    filled a constrained request either way (first tokens stray often: the mask is applied
    before the one read rather than read for again), none for a request without a grammar."""
    import re

    import xgrammar
    fills = {"n": 0}
    fill = xgrammar.GrammarMatcher.fill_next_token_bitmask
    monkeypatch.setattr(xgrammar.GrammarMatcher, "fill_next_token_bitmask",
                        lambda self, *a, **kw: fills.__setitem__("n", fills["n"] + 1) or fill(self, *a, **kw))
    prompts = SAMPLE_PROMPTS[:3]
    firsts = plain.generate(prompts, [dict(GREEDY, max_new_tokens=1)] * 3)
    assert fills["n"] == 0
    # a grammar that allows each prompt's unconstrained first token, then anything short
    allowing = [dict(GREEDY, max_new_tokens=1, regex=re.escape(o["text"]) + "[a-z ]{0,8}") for o in firsts]
    kept = plain.generate(prompts, allowing)
    assert fills["n"] == len(prompts)
    assert [o["output_ids"] for o in kept] == [o["output_ids"] for o in firsts]
    forbidding = [dict(p, max_new_tokens=1) for p in STRAYING]
    fills["n"] = 0
    strayed = plain.generate(prompts, forbidding)
    assert fills["n"] == len(prompts)
    masked = plain.generate(prompts, forbidding, return_logprob=True)
    assert [o["output_ids"] for o in strayed] == [o["output_ids"] for o in masked]
    assert all(o["output_ids"] != f["output_ids"] for o, f in zip(strayed, firsts))
    wait_until_all_kv_is_free(plain)
