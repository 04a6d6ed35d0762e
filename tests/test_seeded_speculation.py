"""Seeded sampling gives the same tokens with and without speculation (issue 13), on SmolLM2
(fp32, CPU): 20 prompts x 64 tokens at temperatures 0.3, 0.8 and 1.2, every request with a
top-k and some with top-p, min-p and penalties, decoded plainly and with NGRAM drafts (one
and multi-branch, 2 to 16 nodes, fixed or adaptive) must give the same output ids; and so
must the same requests sent again once the trie has learned their answers.

One engine serves every configuration: its drafter is swapped between generate calls, so
each configuration starts from a fresh trie. Accept statistics prove that drafts were
verified, not skipped. (CPU time ~3 minutes of one core, most of it the 60 plain requests
and 4 speculative batches of 20 x 64 tokens the issue asks for.)
"""
from __future__ import annotations

import pytest

from specserve.bench.gpu_suite import set_drafter
from specserve.bench.prompts import SAMPLE_PROMPTS
from tests.spec_fixtures import CODE_PROMPT, price_steps

TEMPERATURES = (0.3, 0.8, 1.2)
NEW_TOKENS = 64
# per prompt, cycled: every request has a top-k (so the filters rank only that many tokens)
FILTERS = [
    {"top_k": 40, "top_p": 0.9},
    {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    {"top_k": 50, "frequency_penalty": 0.3, "presence_penalty": 0.2},
    {"top_k": 100, "top_p": 0.95, "min_p": 0.02, "repetition_penalty": 1.05, "frequency_penalty": 0.1},
]
REPEAT_PROMPT = "one, two, three, four, one, two, three, four, one, two,"
COUNT_PROMPT = "Count from 1 to 40: 1, 2, 3, 4, 5,"
# prose and code (little for n-grams to find) and prompts whose answer repeats them
PROMPTS = SAMPLE_PROMPTS + [CODE_PROMPT, REPEAT_PROMPT, COUNT_PROMPT] * 4
# (draft tokens, one branch, adaptive draft length). Batch k sends prompt i at temperature
# TEMPERATURES[(i + k) % 3]: each batch mixes the three temperatures, and the three first
# batches (two configurations, then the trie test's first pass) cover every (prompt,
# temperature) pair. Adaptive configurations verify tiers of 2 to 16 nodes.
CONFIGS = [(16, True, True), (4, False, False)]
# pinned: the test is about the trie, not the policy (which may hold plain); 8 nodes, not 16:
# half the verified tokens per step (the CPU's cost), still ~3x the accepted tokens the second time
RELEARN_CONFIG = (8, False, False)

def request_params(prompt: int, temperature: float) -> dict:
    return {"temperature": temperature, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, "seed": 1000 + prompt,
            **FILTERS[prompt % len(FILTERS)]}


def temperatures_of(config: int) -> list[float]:
    return [TEMPERATURES[(i + config) % len(TEMPERATURES)] for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory(speculative_algorithm="NGRAM", speculative_num_draft_tokens=16,
                          max_total_tokens=8192)


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[list[int]]:
    return [engine.tokenizer(prompt).input_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def plain_outputs(engine, prompt_ids) -> dict[tuple[int, float], list[int]]:
    """Plain decoding of every (prompt, temperature), all in one batch."""
    set_drafter(engine, None)
    keys = [(i, t) for t in TEMPERATURES for i in range(len(PROMPTS))]
    outputs = engine.generate(input_ids=[prompt_ids[i] for i, _ in keys],
                              sampling_params=[request_params(i, t) for i, t in keys])
    assert all(len(out["output_ids"]) == NEW_TOKENS for out in outputs)
    return {key: out["output_ids"] for key, out in zip(keys, outputs)}


def speculative(engine, prompt_ids, temperatures: list[float]) -> tuple[list[list[int]], int]:
    """One batch of every prompt at its temperature with the engine's current drafter.
    Returns (output ids, draft tokens accepted)."""
    params = [request_params(i, t) for i, t in enumerate(temperatures)]
    outputs = engine.generate(input_ids=prompt_ids, sampling_params=params)
    accepted = sum((length - 1) * count for out in outputs
                   for length, count in out["meta_info"]["spec_accept_histogram"].items())
    return [out["output_ids"] for out in outputs], accepted


def mismatches(got: list[list[int]], plain_outputs: dict, temperatures: list[float]) -> list[tuple[int, float, int]]:
    """(prompt, temperature, first differing token) of every output that differs from plain."""
    found = []
    for i, (ids, t) in enumerate(zip(got, temperatures)):
        want = plain_outputs[i, t]
        if ids != want:
            found.append((i, t, next(j for j, (a, b) in enumerate(zip(ids, want + [-1])) if a != b)))
    return found


@pytest.mark.parametrize("config", range(len(CONFIGS)), ids=[f"{n}-{'one' if one else 'multi'}"
                                                            f"{'-adaptive' if adaptive else ''}"
                                                            for n, one, adaptive in CONFIGS])
def test_seeded_speculative_output_equals_plain(engine, prompt_ids, plain_outputs, config):
    set_drafter(engine, *CONFIGS[config])
    if engine.core.adaptive is not None:
        # GPU-like prices (a verified node costs a fiftieth of a plain step): whether the policy
        # drafts then depends on acceptance, not on this CPU's load (on CI's busy 2 cores its
        # own timings held it plain until only 23 draft tokens were accepted)
        price_steps(engine, 0.010, 0.0002)
    temperatures = temperatures_of(config)
    ids, accepted = speculative(engine, prompt_ids, temperatures)
    assert not mismatches(ids, plain_outputs, temperatures)
    assert accepted >= 30, f"only {accepted} draft tokens accepted: speculation barely ran"


def test_same_requests_again_after_the_trie_learned_them(engine, prompt_ids, plain_outputs):
    """The same batch twice on one drafter: the second time the trie holds the answers, so
    other drafts, many more of them accepted, and the same tokens."""
    set_drafter(engine, *RELEARN_CONFIG)
    temperatures = temperatures_of(len(CONFIGS))
    first, accepted_first = speculative(engine, prompt_ids, temperatures)
    again, accepted_again = speculative(engine, prompt_ids, temperatures)
    assert not mismatches(first, plain_outputs, temperatures)
    assert not mismatches(again, plain_outputs, temperatures)
    assert accepted_again > 1.5 * accepted_first, (accepted_first, accepted_again)
