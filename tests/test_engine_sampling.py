"""Engine.generate's sampling parameters, checked against transformers' logits (fp32, CPU).

Most requests go to the engine in one batched `generate` call (the `runs` fixture), so each
test reads its own request's output; every expectation is computed independently: from
transformers' reference logits (penalties applied by hand) or from a plain greedy run.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

PROMPT = "The capital of France is"               # greedy: " Paris.\n\nThe answer is: ..." then EOS at token 30
PENALTY_PROMPT = "one, two, three, one, two, three, one, two,"
GREEDY = {"temperature": 0, "max_new_tokens": 32}
SAMPLE = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
PENALTIES = {
    "repetition": {"repetition_penalty": 1.3},
    "frequency": {"frequency_penalty": 1.0},
    "presence": {"presence_penalty": 1.5},
    "all three": {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5},
}
# settings that leave only the most likely token, whatever the temperature
GREEDY_EQUIVALENTS = {
    "top_k=1": {"temperature": 1.0, "top_k": 1, "seed": 7},
    "tiny top_p": {"temperature": 0.8, "top_p": 1e-6, "seed": 7},
    "min_p=1": {"temperature": 1.5, "min_p": 1.0, "seed": 7},
}


def sample_prompt(engine) -> str:
    return engine.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def runs(engine) -> dict[str, dict]:
    """Every request whose expectation does not depend on another output, in one batch."""
    chat = sample_prompt(engine)
    requests = {
        "base": (PROMPT, GREEDY),
        "sampled": (chat, {**SAMPLE, "seed": 1234}),
        "other seed": (chat, {**SAMPLE, "seed": 4321}),
        "unseeded 1": (chat, SAMPLE),
        "unseeded 2": (chat, SAMPLE),
        "top_k=2": (chat, {**SAMPLE, "temperature": 1.5, "top_k": 2, "seed": 5}),
        "min_new_tokens": (PROMPT, {**GREEDY, "max_new_tokens": 34, "min_new_tokens": 32}),
        "ignore_eos": (PROMPT, {**GREEDY, "max_new_tokens": 34, "ignore_eos": True}),
        "max_new_tokens=1": (PROMPT, {**GREEDY, "max_new_tokens": 1}),
        "max_new_tokens=0": (PROMPT, {**GREEDY, "max_new_tokens": 0}),
        **{name: (PROMPT, {**GREEDY, **params}) for name, params in GREEDY_EQUIVALENTS.items()},
        **{f"penalty: {name}": (PENALTY_PROMPT, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True, **params})
           for name, params in PENALTIES.items()},
    }
    outputs = engine.generate([p for p, _ in requests.values()], [s for _, s in requests.values()],
                              return_logprob=True, top_logprobs_num=5)
    return dict(zip(requests, outputs))


def reference_logits(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """(len(output_ids), vocab) float64: transformers' logits for output token i given the
    prompt and output_ids[:i] (teacher forcing, one forward)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids + output_ids[:-1]])).logits[0, len(prompt_ids) - 1:]
    assert logits.shape[0] == len(output_ids)
    return logits.double()


def penalize(logits: torch.Tensor, prompt_ids: list[int], previous: list[int], repetition_penalty: float = 1.0,
             frequency_penalty: float = 0.0, presence_penalty: float = 0.0) -> torch.Tensor:
    """The penalties written out token by token. Repetition (HF / SGLang): every token of the
    prompt or the output so far, logit / r if positive else logit * r. Frequency and presence
    (OpenAI): output tokens only, logit -= f * count + p * (count > 0)."""
    x = logits.clone()
    for token in set(prompt_ids) | set(previous):
        x[token] = x[token] / repetition_penalty if x[token] > 0 else x[token] * repetition_penalty
    for token in set(previous):
        count = previous.count(token)
        x[token] -= frequency_penalty * count + presence_penalty
    return x


def ids_of(engine, prompt: str) -> list[int]:
    return engine.tokenizer(prompt).input_ids


# ---- logprobs ----
def check_logprobs(output: dict, reference: torch.Tensor) -> None:
    """output_token_logprobs / output_top_logprobs (top 5) against log_softmax(reference)."""
    ids = output["output_ids"]
    meta = output["meta_info"]
    logprobs = torch.log_softmax(reference, dim=-1)
    assert [token for _, token, _ in meta["output_token_logprobs"]] == ids
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]], dtype=torch.float64)
    torch.testing.assert_close(got, logprobs[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4, rtol=0)
    assert len(meta["output_top_logprobs"]) == len(ids)
    for step, row in enumerate(meta["output_top_logprobs"]):
        want_values, want_ids = logprobs[step].topk(5)
        assert [token for _, token, _ in row] == want_ids.tolist(), f"step {step}"
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in row], dtype=torch.float64), want_values,
                                   atol=1e-4, rtol=0)


def test_greedy_logprobs_match_transformers(engine, smollm2_hf, runs):
    base = runs["base"]
    assert base["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}   # ends with <|im_end|>
    reference = reference_logits(smollm2_hf, ids_of(engine, PROMPT), base["output_ids"])
    check_logprobs(base, reference)
    assert base["output_ids"] == reference.argmax(dim=-1).tolist()


def test_sampled_logprobs_match_transformers(engine, smollm2_hf, runs):
    sampled = runs["sampled"]
    reference = reference_logits(smollm2_hf, ids_of(engine, sample_prompt(engine)), sampled["output_ids"])
    check_logprobs(sampled, reference)


# ---- seeds and filters ----
def test_same_seed_gives_same_output_across_calls_and_batches(engine, runs):
    alone = engine.generate(sample_prompt(engine), {**SAMPLE, "seed": 1234})
    assert alone["output_ids"] == runs["sampled"]["output_ids"]
    assert alone["text"] == runs["sampled"]["text"]
    assert len(alone["output_ids"]) == SAMPLE["max_new_tokens"]


def test_different_seeds_give_different_outputs(runs):
    assert runs["other seed"]["output_ids"] != runs["sampled"]["output_ids"]
    # without a seed, each request draws its own
    assert runs["unseeded 1"]["output_ids"] != runs["unseeded 2"]["output_ids"]


@pytest.mark.parametrize("name", GREEDY_EQUIVALENTS)
def test_filters_that_keep_one_token_equal_greedy(runs, name):
    assert runs[name]["output_ids"] == runs["base"]["output_ids"]
    assert runs[name]["text"] == runs["base"]["text"]


def test_top_k_samples_only_from_the_top_k(runs):
    run = runs["top_k=2"]
    # the model's own top tokens at each step (raw logprobs, so temperature does not reorder them)
    top_two = [[token for _, token, _ in row[:2]] for row in run["meta_info"]["output_top_logprobs"]]
    assert all(chosen in top for chosen, top in zip(run["output_ids"], top_two)), (run["output_ids"], top_two)
    # at temperature 1.5 it did sample, not only take the argmax
    assert any(chosen == top[1] for chosen, top in zip(run["output_ids"], top_two))


# ---- penalties ----
@pytest.mark.parametrize("name", PENALTIES)
def test_penalty_equals_hand_rolled_greedy(engine, smollm2_hf, runs, name):
    """Greedy with a penalty must pick, at every step, the argmax of transformers' logits with
    the penalty applied by hand (teacher forcing: equivalent to a hand-rolled greedy loop
    once every step agrees)."""
    params = PENALTIES[name]
    output = runs[f"penalty: {name}"]["output_ids"]
    prompt_ids = ids_of(engine, PENALTY_PROMPT)
    reference = reference_logits(smollm2_hf, prompt_ids, output)
    assert len(output) == 24
    changed_steps = []
    for step, token in enumerate(output):
        penalized = penalize(reference[step], prompt_ids, output[:step], **params)
        best = int(penalized.argmax())
        assert penalized[token] >= penalized[best] - 1e-4, f"step {step}: engine {token}, by hand {best}"
        if int(reference[step].argmax()) != token:
            changed_steps.append(step)
    assert changed_steps, "the penalty never changed the greedy choice: the test proves nothing"
    if "repetition_penalty" in params:
        # the prompt counts for the repetition penalty: " three" is penalised at the very first step
        assert changed_steps[0] == 0
    else:
        # frequency / presence count output tokens only: nothing is penalised at the first step
        assert changed_steps[0] > 0


# ---- stops and lengths ----
def cross_token_stop(tokenizer, output_ids: list[int], text: str) -> tuple[str, int, int]:
    """A stop string made of the last 3 characters of output token i-1 and the first 2 of token
    i, first occurring there. Returns (stop, i, where it starts in text)."""
    for i in range(2, len(output_ids)):
        boundary = len(tokenizer.decode(output_ids[:i], skip_special_tokens=True))
        left = tokenizer.decode(output_ids[i - 1:i])
        right = tokenizer.decode(output_ids[i:i + 1])
        if len(left) >= 3 and len(right) >= 2 and left.strip() and right.strip():
            stop = text[boundary - 3:boundary + 2]
            if text.find(stop) == boundary - 3:
                return stop, i, boundary - 3
    raise AssertionError(f"no two-token stop string in {text!r}")


@pytest.fixture(scope="module")
def stop_case(engine, runs):
    base = runs["base"]
    stop, index, at = cross_token_stop(engine.tokenizer, base["output_ids"], base["text"])
    stop_token = base["output_ids"][5]
    assert stop_token not in base["output_ids"][:5] and stop_token != 2
    requests = [
        {**GREEDY, "stop": ["never in the text", stop]},
        {**GREEDY, "stop": stop, "no_stop_trim": True},
        {**GREEDY, "stop_token_ids": [stop_token]},
    ]
    outputs = engine.generate([PROMPT] * len(requests), requests)
    return {"stop": stop, "index": index, "at": at, "stop_token": stop_token, "outputs": outputs}


def test_stop_string_across_token_boundary(runs, stop_case):
    base, output = runs["base"], stop_case["outputs"][0]
    stop, index = stop_case["stop"], stop_case["index"]
    assert output["text"] == base["text"][:stop_case["at"]]
    assert stop not in output["text"]
    assert output["output_ids"] == base["output_ids"][:index + 1]
    assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_no_stop_trim_keeps_the_stop_string(runs, stop_case):
    output = stop_case["outputs"][1]
    assert output["text"].startswith(runs["base"]["text"][:stop_case["at"]] + stop_case["stop"])
    assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_case["stop"]}


def test_stop_token_ids(engine, runs, stop_case):
    output, stop_token = stop_case["outputs"][2], stop_case["stop_token"]
    assert output["output_ids"] == runs["base"]["output_ids"][:6]
    assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    # as in SGLang and vLLM, the matched stop token's text is not part of the output text
    assert output["text"] == engine.tokenizer.decode(runs["base"]["output_ids"][:5])


def test_min_new_tokens_masks_stops_before_n_tokens(runs):
    base, output = runs["base"]["output_ids"], runs["min_new_tokens"]["output_ids"]
    eos_step = base.index(2)
    assert output[:eos_step] == base[:eos_step]
    assert 2 not in output[:32]
    assert len(output) >= 32


def test_ignore_eos_runs_to_max_new_tokens(runs):
    base, output = runs["base"], runs["ignore_eos"]
    assert output["output_ids"][:len(base["output_ids"])] == base["output_ids"]   # EOS included, then on
    assert len(output["output_ids"]) == 34
    assert output["meta_info"]["finish_reason"] == {"type": "length", "length": 34}
    assert output["text"].startswith(base["text"])


def test_max_new_tokens_one_and_zero(runs):
    one, zero = runs["max_new_tokens=1"], runs["max_new_tokens=0"]
    assert one["output_ids"] == runs["base"]["output_ids"][:1]
    assert one["text"] == " Paris"
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    assert zero["output_ids"] == [] and zero["text"] == ""
    assert zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert zero["meta_info"]["completion_tokens"] == 0


# ---- streaming and async ----
def test_stream_concatenates_to_the_full_output(engine, runs):
    base = runs["base"]
    chunks = list(engine.generate(PROMPT, GREEDY, stream=True, return_logprob=True, top_logprobs_num=5))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == base["text"]
    assert [t for c in chunks for t in c["output_ids"]] == base["output_ids"]
    logprobs = [entry for c in chunks for entry in c["meta_info"]["output_token_logprobs"]]
    assert [t for _, t, _ in logprobs] == base["output_ids"]
    torch.testing.assert_close([lp for lp, _, _ in logprobs],
                               [lp for lp, _, _ in base["meta_info"]["output_token_logprobs"]], atol=1e-4, rtol=0)
    assert chunks[-1]["meta_info"]["finish_reason"] == base["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_stream_never_shows_the_stop_string(engine, stop_case):
    chunks = list(engine.generate(PROMPT, {**GREEDY, "stop": stop_case["stop"]}, stream=True))
    full = stop_case["outputs"][0]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_case["stop"]}


def test_async_generate(engine, smollm2_hf, runs):
    base = runs["base"]
    short = {**GREEDY, "max_new_tokens": 12}

    async def main():
        stream = await engine.async_generate(PROMPT, short, stream=True)

        async def consume():
            return [chunk async for chunk in stream]
        return await asyncio.gather(engine.async_generate(PROMPT, short),
                                    engine.async_generate([PROMPT, PENALTY_PROMPT], short), consume())

    single, pair, chunks = asyncio.run(main())
    assert single["output_ids"] == base["output_ids"][:12]
    assert single["text"] == engine.tokenizer.decode(base["output_ids"][:12])
    assert isinstance(pair, list) and pair[0]["output_ids"] == single["output_ids"]
    other = pair[1]["output_ids"]
    assert len(other) == 12
    assert other == reference_logits(smollm2_hf, ids_of(engine, PENALTY_PROMPT), other).argmax(dim=-1).tolist()
    assert "".join(c["text"] for c in chunks) == single["text"]
    assert [t for c in chunks for t in c["output_ids"]] == single["output_ids"]
