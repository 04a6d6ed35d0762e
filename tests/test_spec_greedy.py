"""Greedy identity of speculative decoding: with NGRAM drafts (trees and single chains, 2 to 16
nodes) the output ids equal plain decoding token for token, whatever else the request asks
for (penalties, stop strings and ids, logprobs, min/max_new_tokens) and under preemption;
on SmolLM2 and on random-weight tiny models loaded from Hugging Face directories (fp32, CPU).

Every expectation is the plain engine's output for the same request. Accept lengths and the
accept histograms prove drafts were verified (and, for stops, cut in the middle of a path)
rather than skipped.
"""
from __future__ import annotations

import pytest
import torch

from specserve.bench.prompts import SAMPLE_PROMPTS

from tests.spec_fixtures import (
    CODE_PROMPT,
    ProposeSpy,
    SmolEngines,
    make_tiny_directory,
    ngram_args,
    tiny_engine,
    truncated_mid_path,
    wait_until_all_kv_is_free,
)

PROMPTS = SAMPLE_PROMPTS[:7]   # the first one ends in EOS after ~25 tokens
GREEDY = {"temperature": 0, "max_new_tokens": 32}
CODE_GREEDY = {"temperature": 0, "max_new_tokens": 32}
PENALTIES = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5}
REPEAT_PROMPT = "one, two, three, one, two, three, one, two,"
STOP_AT = (12, 21, 30)              # output tokens at which the stop-string candidates complete
STOP_TOKEN_FROM = 14                # the stop token: the first output token from here on not seen before
# (num_draft_tokens, one_branch): with 2 nodes a tree is a chain, so one engine covers both
COMBOS = [(2, False), (4, False), (4, True), (8, False), (8, True), (16, False), (16, True)]


# ---- engines and the plain reference ----
@pytest.fixture(scope="module")
def smol(smollm2_path, smollm2_checkpoint):
    engines = SmolEngines(smollm2_path, smollm2_checkpoint)
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def plain(smol):
    return smol.make()


@pytest.fixture(scope="module")
def code_ids(plain) -> list[int]:
    return plain.tokenizer(CODE_PROMPT).input_ids


@pytest.fixture(scope="module")
def main_engine(smol, code_ids):
    """The engine of the mixed batch, its trie warmed by one run of the code prompt (so the
    batch's copies of it accept long paths); returns (engine, that run's output)."""
    engine = smol.make(**ngram_args(6))
    yield engine, engine.generate(input_ids=code_ids, sampling_params=CODE_GREEDY)
    smol.close(engine)


def stop_token_index(output_ids: list[int]) -> int:
    return next(i for i in range(STOP_TOKEN_FROM, len(output_ids)) if output_ids[i] not in output_ids[:i])


def stop_string_ending_at(tokenizer, output_ids: list[int], text: str, index: int) -> str:
    """The shortest string (>= 3 chars) that ends inside output token `index` and first occurs
    in the text there, so it stops the output right after that token."""
    end = len(tokenizer.decode(output_ids[:index + 1], skip_special_tokens=True))
    start = len(tokenizer.decode(output_ids[:index], skip_special_tokens=True))
    assert end > start, f"token {index} adds no text"
    for length in range(3, end + 1):
        stop = text[end - length:end]
        if stop.strip() and text.find(stop) == end - length:
            return stop
    raise AssertionError(f"no stop string ends at token {index} of {text!r}")


@pytest.fixture(scope="module")
def requests(plain, code_ids, main_engine) -> dict[str, tuple[list[int], dict]]:
    """Everything the mixed batch runs, by name. Stops are placed on the code prompt's output
    (the warm-up's; test_batch_of_mixed_prompts_equals_plain checks it is the plain one)."""
    warm = main_engine[1]
    tokenizer, code_out, code_text = plain.tokenizer, warm["output_ids"], warm["text"]
    assert len(code_out) == CODE_GREEDY["max_new_tokens"]
    stop_token = code_out[stop_token_index(code_out)]
    ids = lambda prompt: tokenizer(prompt).input_ids
    return {
        "prompt 0": (ids(PROMPTS[0]), {**GREEDY, "max_new_tokens": 40}),
        **{f"prompt {i}": (ids(p), GREEDY) for i, p in enumerate(PROMPTS) if i > 0},
        "code": (code_ids, CODE_GREEDY),
        "repeat": (ids(REPEAT_PROMPT), {**GREEDY, "ignore_eos": True}),
        "penalties code": (code_ids, {**CODE_GREEDY, **PENALTIES}),
        "penalties repeat": (ids(REPEAT_PROMPT), {**GREEDY, **PENALTIES, "max_new_tokens": 24, "ignore_eos": True}),
        **{f"stop {at}": (code_ids, {**CODE_GREEDY, "stop": ["never in the text",
                                                             stop_string_ending_at(tokenizer, code_out, code_text, at)]})
           for at in STOP_AT},
        "stop token": (code_ids, {**CODE_GREEDY, "stop_token_ids": [stop_token]}),
        "max_new_tokens=1": (ids(PROMPTS[5]), {**GREEDY, "max_new_tokens": 1}),
        "capital min_new_tokens": (ids(PROMPTS[0]), {**GREEDY, "max_new_tokens": 40, "min_new_tokens": 36}),
        # one sampled request: while it runs the batch goes through verify_sampling, whose
        # temperature-0 rows must give the greedy result
        "sampled": (ids(PROMPTS[2]), {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "seed": 1}),
    }


def run_batch(engine, requests: dict) -> dict[str, dict]:
    outputs = engine.generate(input_ids=[ids for ids, _ in requests.values()],
                              sampling_params=[params for _, params in requests.values()],
                              return_logprob=True, top_logprobs_num=5)
    return dict(zip(requests, outputs))


@pytest.fixture(scope="module")
def plain_runs(plain, requests) -> dict[str, dict]:
    # not the sampled request: its tokens depend on the random numbers speculation draws
    return run_batch(plain, {name: request for name, request in requests.items() if name != "sampled"})


# ---- a batch of mixed requests with every output option ----
@pytest.fixture(scope="module")
def spec_runs(smol, main_engine, requests) -> dict[str, dict]:
    engine = main_engine[0]
    runs = run_batch(engine, requests)
    stream_ids, stream_params = requests[f"stop {STOP_AT[1]}"]
    runs["stream chunks"] = list(engine.generate(input_ids=stream_ids, sampling_params=stream_params, stream=True))
    wait_until_all_kv_is_free(engine)
    smol.close(engine)       # before the other engines come
    return runs


def test_batch_of_mixed_prompts_equals_plain(plain_runs, spec_runs, main_engine):
    assert main_engine[1]["output_ids"] == plain_runs["code"]["output_ids"]      # the solo warm-up run
    for name in [f"prompt {i}" for i in range(len(PROMPTS))] + ["code", "repeat"]:
        assert spec_runs[name]["output_ids"] == plain_runs[name]["output_ids"], name
        assert spec_runs[name]["text"] == plain_runs[name]["text"], name
        assert spec_runs[name]["meta_info"]["finish_reason"] == plain_runs[name]["meta_info"]["finish_reason"], name
        assert spec_runs[name]["meta_info"]["spec_verify_ct"] > 0, name
    assert spec_runs["code"]["meta_info"]["spec_accept_length"] > 3.0
    assert spec_runs["repeat"]["meta_info"]["spec_accept_length"] > 2.0
    assert spec_runs["sampled"]["meta_info"]["spec_verify_ct"] > 0 and len(spec_runs["sampled"]["output_ids"]) == 40


@pytest.mark.parametrize("name", ["penalties code", "penalties repeat"])
def test_penalties_equal_plain(plain_runs, spec_runs, name):
    spec, want = spec_runs[name], plain_runs[name]
    assert spec["output_ids"] == want["output_ids"]
    # the penalties changed the output, so a tree node that ignored its ancestors' tokens would show
    unpenalized = plain_runs["code" if name == "penalties code" else "repeat"]["output_ids"]
    assert want["output_ids"] != unpenalized[:len(want["output_ids"])]
    assert spec["meta_info"]["spec_verify_ct"] > 0


def test_penalties_tree_nodes_were_accepted(spec_runs):
    """Drafts are accepted under penalties too (else the identity above proves nothing about tree nodes)."""
    accepted = [length for name in ("penalties code", "penalties repeat")
                for length in spec_runs[name]["meta_info"]["spec_accept_histogram"] if length > 1]
    assert accepted


def test_stop_strings_equal_plain_and_cut_accepted_paths(plain_runs, spec_runs):
    for at in STOP_AT:
        spec, want = spec_runs[f"stop {at}"], plain_runs[f"stop {at}"]
        assert want["meta_info"]["finish_reason"]["type"] == "stop"
        assert len(want["output_ids"]) == at + 1
        assert spec["output_ids"] == want["output_ids"], at
        assert spec["text"] == want["text"], at
        assert spec["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], at
    # at least one stop fell inside a multi-token accepted path (the tokens after it were dropped)
    assert any(truncated_mid_path(spec_runs[f"stop {at}"]) for at in STOP_AT), \
        [spec_runs[f"stop {at}"]["meta_info"]["spec_accept_histogram"] for at in STOP_AT]


def test_stop_token_ids_equal_plain(plain_runs, spec_runs):
    spec, want = spec_runs["stop token"], plain_runs["stop token"]
    code_out = plain_runs["code"]["output_ids"]
    assert want["output_ids"] == code_out[:stop_token_index(code_out) + 1]
    assert spec["output_ids"] == want["output_ids"]
    assert spec["text"] == want["text"]
    assert spec["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert spec["meta_info"]["finish_reason"]["type"] == "stop"


def test_stream_chunks_concatenate_to_the_output(plain_runs, spec_runs, requests):
    """Streaming a request whose steps commit several tokens, with a stop string: the chunks add
    up to the plain output and never show the stop string."""
    chunks, name = spec_runs["stream chunks"], f"stop {STOP_AT[1]}"
    want, stop = plain_runs[name], requests[name][1]["stop"][1]
    assert sum((chunk["output_ids"] for chunk in chunks), []) == want["output_ids"]
    assert "".join(chunk["text"] for chunk in chunks) == want["text"]
    assert any(len(chunk["output_ids"]) > 1 for chunk in chunks)        # steps that committed several tokens
    shown = ""
    for chunk in chunks:
        shown += chunk["text"]
        assert stop not in shown
    assert chunks[-1]["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def top_rows_agree(got: list, want: list, atol: float) -> bool:
    """Top-k rows agree: values within atol, ids equal except where two values tie within atol."""
    values_got, values_want = [v for v, _, _ in got], [v for v, _, _ in want]
    if len(got) != len(want) or any(abs(a - b) > atol for a, b in zip(values_got, values_want)):
        return False
    for k, ((_, id_got, _), (_, id_want, _)) in enumerate(zip(got, want)):
        if id_got != id_want:
            tied = [j for j in range(len(want)) if abs(values_want[j] - values_want[k]) <= atol]
            if id_got not in {want[j][1] for j in tied} and not (k == len(want) - 1 or k + 1 in tied):
                return False
    return True


def test_logprobs_equal_plain(plain_runs, spec_runs):
    for name, want in plain_runs.items():   # every greedy request of the batch asked for logprobs
        spec = spec_runs[name]
        assert spec["output_ids"] == want["output_ids"], name
        got_lp, want_lp = spec["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in got_lp] == [t for _, t, _ in want_lp] == want["output_ids"], name
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in got_lp]), torch.tensor([lp for lp, _, _ in want_lp]),
                                   atol=1e-4, rtol=0, msg=name)
        got_top, want_top = spec["meta_info"]["output_top_logprobs"], want["meta_info"]["output_top_logprobs"]
        assert len(got_top) == len(want_top) == len(want["output_ids"]), name
        for step, (got_row, want_row) in enumerate(zip(got_top, want_top)):
            assert top_rows_agree(got_row, want_row, 1e-4), (name, step, got_row, want_row)


def test_max_new_tokens_one(plain_runs, spec_runs):
    spec, want = spec_runs["max_new_tokens=1"], plain_runs["max_new_tokens=1"]
    assert spec["output_ids"] == want["output_ids"] == plain_runs["prompt 5"]["output_ids"][:1]
    assert spec["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    assert spec["meta_info"]["spec_verify_ct"] == 0          # the prefill made the only token


def test_min_new_tokens_equal_plain(plain_runs, spec_runs):
    base, want, spec = plain_runs["prompt 0"], plain_runs["capital min_new_tokens"], spec_runs["capital min_new_tokens"]
    assert 2 in base["output_ids"] and base["output_ids"].index(2) < 35    # EOS comes early without min_new_tokens
    assert 2 not in want["output_ids"][:36]
    assert spec["output_ids"] == want["output_ids"]
    assert spec["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert spec_runs["prompt 0"]["output_ids"] == base["output_ids"]


# ---- batch 1, every draft size and shape: a code-editing prompt, twice ----
@pytest.fixture(scope="module", params=COMBOS, ids=lambda c: f"n{c[0]}-{'chain' if c[1] else 'tree'}")
def combo_engine(request, smol):
    engine = smol.make(**ngram_args(*request.param))
    yield engine
    smol.close(engine)


def test_code_prompt_twice_equals_plain(combo_engine, code_ids, plain_runs):
    plain_code = plain_runs["code"]
    first = combo_engine.generate(input_ids=code_ids, sampling_params=CODE_GREEDY)
    second = combo_engine.generate(input_ids=code_ids, sampling_params=CODE_GREEDY)   # drafts from the first's output too
    assert first["output_ids"] == plain_code["output_ids"]
    assert second["output_ids"] == plain_code["output_ids"]
    assert first["text"] == second["text"] == plain_code["text"]
    # drafts were verified and accepted, not skipped
    assert first["meta_info"]["spec_accept_length"] > 1.3, first["meta_info"]
    assert second["meta_info"]["spec_accept_length"] >= first["meta_info"]["spec_accept_length"], second["meta_info"]
    assert first["meta_info"]["finish_reason"] == {"type": "length", "length": CODE_GREEDY["max_new_tokens"]}


# ---- preemption ----
def test_preemption_keeps_outputs(smol, requests, plain_runs):
    names = ["repeat", "prompt 3", "prompt 5"]
    # 64 cache tokens cannot hold these three requests of 37-47 tokens; each one alone fits
    engine = smol.make(**ngram_args(4, one_branch=True), max_total_tokens=64)
    try:
        outputs = engine.generate(input_ids=[requests[n][0] for n in names], sampling_params=[requests[n][1] for n in names])
        for name, out in zip(names, outputs):
            assert out["output_ids"] == plain_runs[name]["output_ids"], name
        assert sum(out["meta_info"]["preemptions"] for out in outputs) > 0
        assert outputs[0]["meta_info"]["spec_accept_length"] > 1.3
        wait_until_all_kv_is_free(engine)
    finally:
        smol.close(engine)


# ---- random-weight tiny models from Hugging Face directories ----
TINY_PROMPTS = [
    [5, 6, 7, 8, 9] * 6 + [10, 11],
    [20, 21, 22, 23] * 5 + [20, 21],
    list(range(30, 60)) + list(range(30, 42)),
    [100, 101, 102, 103, 104, 105] * 3 + [7],
]
TINY_GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_directory(path, request.param)
    return path


@pytest.mark.parametrize("combo", [(8, False), (4, True)], ids=["n8-tree", "n4-chain"])
def test_tiny_random_model_equals_plain(tiny_dir, combo):
    with tiny_engine(tiny_dir) as plain, tiny_engine(tiny_dir, **ngram_args(*combo)) as spec:
        want = [o["output_ids"] for o in plain.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)]
        spy = ProposeSpy(spec.core.drafter)
        first = spec.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)
        # the same prompts again: the trie now holds the outputs, so whole drafts get accepted
        second = spec.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)
        assert [o["output_ids"] for o in first] == want
        assert [o["output_ids"] for o in second] == want
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in first + second)
        assert spy.drafted_nodes > 0
        assert all(o["meta_info"]["spec_accept_length"] > 2.0 for o in second), [o["meta_info"] for o in second]

        # each output's third token as a stop token, masked for 12 tokens, with penalties: the
        # drafts (from the unmasked outputs) propose it at masked depths
        params = [{**TINY_GREEDY, "stop_token_ids": [out[2]], "min_new_tokens": 12,
                   "repetition_penalty": 1.1, "frequency_penalty": 0.2} for out in want]
        want_stopped = plain.generate(input_ids=TINY_PROMPTS, sampling_params=params)
        for _ in range(2):
            stopped = spec.generate(input_ids=TINY_PROMPTS, sampling_params=params)
            assert [o["output_ids"] for o in stopped] == [o["output_ids"] for o in want_stopped]
            assert [o["meta_info"]["finish_reason"] for o in stopped] == [o["meta_info"]["finish_reason"] for o in want_stopped]
        assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in want_stopped)
        assert any(max(o["meta_info"]["spec_accept_histogram"]) > 2 for o in stopped)
        wait_until_all_kv_is_free(spec)


def test_mixed_chunks_equal_plain(tiny_dir):
    """--enable-mixed-chunk with NGRAM: prompt chunks ride in decode steps (whose decoding
    requests take one token there, no draft) and every output is still plain's."""
    chunked = {"chunked_prefill_size": 16}   # the prompts (19-42 tokens) prefill in chunks while others decode
    with tiny_engine(tiny_dir, **chunked) as plain, \
            tiny_engine(tiny_dir, enable_mixed_chunk=True, **chunked, **ngram_args(8)) as spec:
        want = [o["output_ids"] for o in plain.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)]
        scheduler, mixed_steps = spec.core.scheduler, []
        schedule_extend = scheduler._schedule_extend

        def counting(decoding):
            batch, decoded = schedule_extend(decoding)
            if batch is not None and decoded:
                mixed_steps.append(decoded)
            return batch, decoded
        scheduler._schedule_extend = counting
        first = spec.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)
        second = spec.generate(input_ids=TINY_PROMPTS, sampling_params=TINY_GREEDY)   # drafts from the first's outputs
        assert [o["output_ids"] for o in first] == want
        assert [o["output_ids"] for o in second] == want
        assert mixed_steps, "no prompt chunk rode in a decode step"
        assert all(o["meta_info"]["spec_accept_length"] > 2.0 for o in second), [o["meta_info"] for o in second]
        wait_until_all_kv_is_free(spec)
