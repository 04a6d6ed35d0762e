"""Malformed and hostile requests, each of which the server must refuse with a 4xx
OpenAI-style error (never a 5xx, never a traceback), whatever else it is serving."""
from __future__ import annotations

INT64_OVERFLOW = 2 ** 63
DEEP_MESSAGES = b'{"messages": [{"role": "user", "content": "hi"}, ' + b"[" * 100_000 + b"]" * 100_000 + b"]}"
DEEP_UNKNOWN_FIELD = b'{"prompt": "hi", "max_tokens": 2, "extra": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"


def malformed_requests(model: str) -> list[tuple[str, str, object]]:
    """(method, path, JSON body or raw bytes) for every kind of bad request."""
    ok = {"model": model, "prompt": "hi", "max_tokens": 2}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    return [
        # --- the body itself ---
        ("POST", "/v1/completions", b'{"prompt": "hi", '),                        # malformed JSON
        ("POST", "/v1/completions", b"[1, 2]"),                                   # not an object
        ("POST", "/v1/completions", b""),
        ("POST", "/v1/completions", b'\xff\xfe{"prompt": 1}'),                    # not UTF-8
        ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}'),
        ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": -Infinity}'),
        ("POST", "/v1/completions", b'{"prompt": "hi", "temperature": 1e400}'),  # overflows a float
        ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
        ("POST", "/v1/chat/completions", DEEP_MESSAGES),
        ("POST", "/v1/completions", DEEP_UNKNOWN_FIELD),
        ("POST", "/generate", b'{"text": "hi", "sampling_params": ' + b'{"a": ' * 200 + b"1" + b"}" * 201),
        ("POST", "/v1/completions", b'{"prompt": "' + b"x" * (17 * 1024 * 1024) + b'"}'),   # over the size cap
        ("POST", "/v1/completions", {**ok, "prompt": "word " * 1_000_000}),     # 5 MB: refused untokenized
        # --- /v1/completions fields ---
        ("POST", "/v1/completions", {"model": model}),                            # prompt missing
        ("POST", "/v1/completions", {**ok, "prompt": 5}),
        ("POST", "/v1/completions", {**ok, "prompt": ""}),
        ("POST", "/v1/completions", {**ok, "prompt": []}),
        ("POST", "/v1/completions", {**ok, "temperature": "hot"}),
        ("POST", "/v1/completions", {**ok, "temperature": 5}),
        ("POST", "/v1/completions", {**ok, "top_p": 1.5}),
        ("POST", "/v1/completions", {**ok, "max_tokens": -1}),
        ("POST", "/v1/completions", {**ok, "max_tokens": 1.5}),
        ("POST", "/v1/completions", {**ok, "max_tokens": INT64_OVERFLOW}),
        ("POST", "/v1/completions", {**ok, "n": 2}),
        ("POST", "/v1/completions", {**ok, "best_of": INT64_OVERFLOW}),
        ("POST", "/v1/completions", b'{"prompt": "cut inside an emoji \\ud83d", "max_tokens": 2}'),  # a lone surrogate
        ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "model": "\\udc00"}'),
        ("POST", "/v1/completions", {**ok, "prompt": "hello " * 9000}),           # longer than the context
        ("POST", "/v1/completions", {**ok, "prompt": [7] * 2000}),                # fits the context, not the cache
        ("POST", "/v1/completions", {**ok, "max_tokens": 9000}),                  # prompt + output too long
        ("POST", "/v1/completions", {**ok, "logprobs": 30}),
        ("POST", "/v1/completions", {**ok, "stop": 5}),
        ("POST", "/v1/completions", {**ok, "stop": [""]}),
        ("POST", "/v1/completions", {**ok, "stop": [f"s{i}" for i in range(65)]}),
        ("POST", "/v1/completions", {**ok, "stop": "x" * 5000}),
        ("POST", "/v1/completions", {**ok, "stop_token_ids": [-5]}),
        ("POST", "/v1/completions", {**ok, "seed": -1}),
        ("POST", "/v1/completions", {**ok, "seed": INT64_OVERFLOW}),
        ("POST", "/v1/completions", {**ok, "top_k": INT64_OVERFLOW}),
        ("POST", "/v1/completions", {**ok, "min_tokens": INT64_OVERFLOW}),
        ("POST", "/v1/completions", {**ok, "stream": "yes"}),
        ("POST", "/v1/completions", {**ok, "presence_penalty": 3}),
        ("POST", "/v1/completions", {**ok, "repetition_penalty": 0}),
        ("POST", "/v1/completions", {**ok, "logit_bias": {"42": 10}}),
        ("POST", "/v1/completions", {**ok, "stream_options": {"include_usage": True}}),   # without stream
        ("POST", "/v1/completions", {**ok, "prompt": [10 ** 9]}),                 # token id outside the vocab
        ("POST", "/v1/completions", {**ok, "prompt": [-1], "echo": True}),
        # --- /v1/chat/completions fields ---
        ("POST", "/v1/chat/completions", {**chat, "messages": []}),
        ("POST", "/v1/chat/completions", {**chat, "messages": "hi"}),
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "hi"}]}),
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": 7}]}),
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user"}]}),       # no content
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": None}]}),
        ("POST", "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        ("POST", "/v1/chat/completions", {**chat, "top_logprobs": 2}),           # without logprobs
        ("POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}),
        ("POST", "/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "no such type"}}}]}),
        ("POST", "/v1/chat/completions", {**chat, "response_format": {"type": "json_schema"}}),   # no schema
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "system", "content": "\\ud800"}, '
                                         b'{"role": "user", "content": "hi"}]}'),
        ("POST", "/v1/chat/completions", {**chat, "top_k": INT64_OVERFLOW}),
        ("POST", "/v1/chat/completions", {**chat, "max_completion_tokens": -3}),
        # --- /generate ---
        ("POST", "/generate", {**gen, "input_ids": [1, 2]}),                       # both text and input_ids
        ("POST", "/generate", {"sampling_params": {}}),                            # neither
        ("POST", "/generate", {**gen, "sampling_params": {"temprature": 0.5}}),    # unknown sampling key
        ("POST", "/generate", {**gen, "sampling_params": {"temperature": -1}}),
        ("POST", "/generate", {**gen, "sampling_params": {"temperature": 10 ** 400}}),
        ("POST", "/generate", {**gen, "sampling_params": {"max_new_tokens": "many"}}),
        ("POST", "/generate", {**gen, "sampling_params": {"top_k": INT64_OVERFLOW}}),
        ("POST", "/generate", {**gen, "sampling_params": {"seed": INT64_OVERFLOW}}),
        ("POST", "/generate", {**gen, "sampling_params": {"stop_token_ids": list(range(2000))}}),
        ("POST", "/generate", {**gen, "sampling_params": [{}, {}]}),               # two for one prompt
        ("POST", "/generate", {**gen, "top_logprobs_num": -1}),
        ("POST", "/generate", {**gen, "logprob_start_len": INT64_OVERFLOW}),
        ("POST", "/generate", {**gen, "unknown_field": 1}),
        ("POST", "/generate", {"input_ids": [10 ** 9]}),
        ("POST", "/generate", {"input_ids": [[1, 2], []]}),
        ("POST", "/generate", {"text": ""}),
        ("POST", "/generate", {"text": ["a", "b"], "rid": ["same", "same"]}),
        ("POST", "/generate", b'{"text": "\\udfff", "sampling_params": {"max_new_tokens": 2}}'),
        # --- /tokenize, /detokenize ---
        ("POST", "/tokenize", {"prompt": 5}),
        ("POST", "/tokenize", b'{"prompt": ["ok", "\\ud800"]}'),
        ("POST", "/detokenize", {"tokens": [-1]}),
        ("POST", "/detokenize", {"tokens": [INT64_OVERFLOW]}),
        ("POST", "/detokenize", {"tokens": [[1], [10 ** 9]]}),
        # --- routes ---
        ("GET", "/v1/completions", None),                                          # wrong method
        ("GET", "/no/such/route", None),
        ("GET", "/v1/models/gpt-4", None),                                         # a model this server lacks
    ]
