"""Bad input fails fast with an error that names the culprit, and never harms the engine:
after each rejected request, the same engine still serves a request correctly."""
from __future__ import annotations

import json
import threading
import time

import pytest

from specserve.args import ServerArgs
from specserve.engine.engine import Engine

PROMPT = "The capital of France is"
CHECK = {"temperature": 0, "max_new_tokens": 4}


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def good_output(engine) -> list[int]:
    output = engine.generate(PROMPT, CHECK)["output_ids"]
    assert len(output) == 4
    return output


def assert_still_serving(engine, good_output) -> None:
    assert engine.generate(PROMPT, CHECK)["output_ids"] == good_output


# (sampling_params, exception, message pattern): each a different way to get a parameter wrong
BAD_SAMPLING_PARAMS = {
    "negative max_new_tokens": ({"max_new_tokens": -1}, ValueError, "max_new_tokens"),
    "top_p > 1": ({"top_p": 1.5}, ValueError, "top_p"),
    "top_p < 0": ({"top_p": -0.1}, ValueError, "top_p"),
    "top_k past int64": ({"top_k": 2 ** 63}, ValueError, "top_k"),
    "seed past int64": ({"seed": 2 ** 63}, ValueError, "seed"),
    "negative temperature": ({"temperature": -0.5}, ValueError, "temperature"),
    "nan temperature": ({"temperature": float("nan")}, ValueError, "temperature"),
    "top_k < -1": ({"top_k": -2}, ValueError, "top_k"),
    "min_p > 1": ({"min_p": 1.5}, ValueError, "min_p"),
    "repetition_penalty = 0": ({"repetition_penalty": 0}, ValueError, "repetition_penalty"),
    "frequency_penalty > 2": ({"frequency_penalty": 3}, ValueError, "frequency_penalty"),
    "presence_penalty < -2": ({"presence_penalty": -3}, ValueError, "presence_penalty"),
    "negative seed": ({"seed": -1}, ValueError, "seed"),
    "n > 1": ({"n": 2}, ValueError, r"\bn\b"),
    "min_new_tokens > max_new_tokens": ({"min_new_tokens": 10, "max_new_tokens": 5}, ValueError, "min_new_tokens"),
    "unknown key": ({"max_tokens": 5}, ValueError, "max_tokens"),
    "max_new_tokens as str": ({"max_new_tokens": "5"}, (TypeError, ValueError), "max_new_tokens"),
    "max_new_tokens as bool": ({"max_new_tokens": True}, (TypeError, ValueError), "max_new_tokens"),
    "max_new_tokens as float": ({"max_new_tokens": 5.0}, (TypeError, ValueError), "max_new_tokens"),
    "temperature as str": ({"temperature": "hot"}, (TypeError, ValueError), "temperature"),
    "stop as int": ({"stop": 5}, (TypeError, ValueError), "stop"),
    "empty stop string": ({"stop": ["ok", ""]}, ValueError, "stop"),
    "stop_token_ids of str": ({"stop_token_ids": ["a"]}, (TypeError, ValueError), "stop_token_ids"),
    "ignore_eos as str": ({"ignore_eos": "yes"}, (TypeError, ValueError), "ignore_eos"),
}


@pytest.mark.parametrize("case", BAD_SAMPLING_PARAMS)
def test_bad_sampling_params(engine, good_output, case):
    params, error, pattern = BAD_SAMPLING_PARAMS[case]
    with pytest.raises(error, match=pattern):
        engine.generate(PROMPT, params)
    assert_still_serving(engine, good_output)


def too_long(engine) -> list[int]:
    return [100] * (engine.context_length + 5)


# each: a function of the engine making the bad call, exception, message pattern
BAD_REQUESTS = {
    "empty prompt": (lambda e: e.generate("", CHECK), ValueError, "prompt"),
    "prompt not a string": (lambda e: e.generate(123, CHECK), ValueError, "prompt"),
    "prompt list with a non-string": (lambda e: e.generate([PROMPT, None], CHECK), ValueError, "prompt"),
    "empty input_ids": (lambda e: e.generate(input_ids=[], sampling_params=CHECK), ValueError, "input_ids"),
    "token id out of vocab": (lambda e: e.generate(input_ids=[1, 2, e.core.runner.config.vocab_size],
                                                   sampling_params=CHECK), ValueError, "input_ids"),
    "negative token id": (lambda e: e.generate(input_ids=[1, -1], sampling_params=CHECK), ValueError, "input_ids"),
    "float token id": (lambda e: e.generate(input_ids=[1, 2.0], sampling_params=CHECK), ValueError, "input_ids"),
    "prompt longer than the context": (lambda e: e.generate(input_ids=too_long(e), sampling_params=CHECK),
                                       ValueError, "context length"),
    "sampling_params not a dict": (lambda e: e.generate(PROMPT, "greedy"), ValueError, "sampling_params"),
    "sampling_params list of non-dicts": (lambda e: e.generate([PROMPT], [0.5]), ValueError, "sampling_params"),
    "more sampling_params than prompts": (lambda e: e.generate([PROMPT, PROMPT], [CHECK] * 3),
                                          ValueError, "sampling_params"),
    "both prompt and input_ids": (lambda e: e.generate(PROMPT, CHECK, input_ids=[1, 2]), ValueError,
                                  "prompt and input_ids"),
    "neither prompt nor input_ids": (lambda e: e.generate(sampling_params=CHECK), ValueError,
                                     "prompt and input_ids"),
    "negative top_logprobs_num": (lambda e: e.generate(PROMPT, CHECK, top_logprobs_num=-1), ValueError,
                                  "top_logprobs_num"),
    "stream of several prompts": (lambda e: e.generate([PROMPT, PROMPT], CHECK, stream=True), ValueError,
                                  "stream"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS)
def test_bad_requests(engine, good_output, case):
    call, error, pattern = BAD_REQUESTS[case]
    with pytest.raises(error, match=pattern):
        call(engine)
    assert_still_serving(engine, good_output)


def test_async_generate_raises_the_same_errors(engine, good_output):
    import asyncio
    with pytest.raises(ValueError, match="top_p"):
        asyncio.run(engine.async_generate(PROMPT, {"top_p": 2}))
    assert_still_serving(engine, good_output)


def test_request_id_in_use_is_rejected(engine, good_output):
    """The core rejects a second request under a running request's id; the error reaches the
    caller and the first request is unharmed."""
    first = {}

    def run_first():   # long enough to still run when the second request comes; aborted below
        first["output"] = engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 500}, rid="same-id")

    thread = threading.Thread(target=run_first)
    thread.start()
    deadline = time.monotonic() + 60
    while "same-id" not in engine.core.requests:
        assert time.monotonic() < deadline, "the first request never started"
        time.sleep(0.01)
    with pytest.raises(ValueError, match="request id"):
        engine.generate(PROMPT, CHECK, rid="same-id")
    engine.abort_request("same-id")
    thread.join(timeout=60)
    output = first["output"]
    assert output["meta_info"]["finish_reason"]["type"] == "abort"
    assert output["output_ids"][:4] == good_output[:len(output["output_ids"][:4])]
    assert_still_serving(engine, good_output)


# ---- engine construction ----
def write_gpt2_directory(path) -> str:
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 64, "n_embd": 32,
              "n_layer": 1, "n_head": 2, "n_positions": 64}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


# each: Engine kwargs, exception, message pattern; all fail before (or instead of) loading weights
BAD_ENGINES = {
    "unknown kwarg": ({"no_such_option": 1}, TypeError, "no_such_option"),
    "unknown speculative kwarg": ({"speculative_foo": 1}, TypeError, "speculative_foo"),
    "mem_fraction_static = 2": ({"mem_fraction_static": 2}, ValueError, "mem_fraction_static"),
    "chunked_prefill_size = 0": ({"chunked_prefill_size": 0}, ValueError, "chunked_prefill_size"),
    "max_total_tokens = 0": ({"max_total_tokens": 0}, ValueError, "max_total_tokens"),
    "context_length as str": ({"context_length": "4k"}, ValueError, "context_length"),
    "max_running_requests < 0": ({"max_running_requests": -1}, ValueError, "max_running_requests"),
    "unknown dtype": ({"dtype": "float8"}, ValueError, "dtype"),
    "unknown attention backend": ({"attention_backend": "flash"}, ValueError, "attention_backend"),
    "tensor parallelism that does not split the heads": ({"tp_size": 2}, ValueError,
                                                          "tp_size=2 must divide the model's 9 attention heads"),
    "unknown speculative algorithm": ({"speculative_algorithm": "MEDUSA"}, ValueError, "speculative_algorithm"),
    "EAGLE without a head": ({"speculative_algorithm": "EAGLE3"}, ValueError, "speculative_draft_model_path"),
    "NAIVE_EAGLE with a tree": ({"speculative_algorithm": "NAIVE_EAGLE", "speculative_draft_model_path": "x",
                                 "speculative_eagle_topk": 2}, ValueError, "speculative_eagle_topk"),
    "EAGLE draft model": ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"},
                          NotImplementedError, "speculative_draft_model_path"),
    "non-existent model path": ({"model_path": "/no/such/model.gguf"}, FileNotFoundError, "/no/such/model.gguf"),
    "directory without config.json": ({"model_path": "<tmp>"}, FileNotFoundError, "config.json"),
    "file that is not a GGUF": ({"model_path": "<tmp>/weights.bin"}, ValueError, "gguf"),
}


@pytest.mark.parametrize("case", BAD_ENGINES)
def test_bad_engine_arguments(tmp_path, case):
    kwargs, error, pattern = BAD_ENGINES[case]
    if "model_path" in kwargs:
        (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
        kwargs = {**kwargs, "model_path": kwargs["model_path"].replace("<tmp>", str(tmp_path))}
    with pytest.raises(error, match=pattern):
        Engine(**{"dtype": "float32", "device": "cpu", "log_level": "warning", **kwargs})


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        Engine(model_path=write_gpt2_directory(tmp_path), dtype="float32", device="cpu", log_level="warning")


def test_server_args_reject_the_same_values_directly():
    """ServerArgs (what the CLI builds) validates on construction too, not only Engine."""
    with pytest.raises(ValueError, match="mem_fraction_static"):
        ServerArgs(mem_fraction_static=2.0)
    with pytest.raises(NotImplementedError, match="speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_draft_model_path="x")
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        ServerArgs(tp_size=0)
    with pytest.raises(ValueError, match="(?i)naive_eagle.*speculative_draft_model_path"):
        ServerArgs(speculative_algorithm="naive_eagle")
    assert ServerArgs(speculative_algorithm="lookahead").speculative == "NGRAM"
