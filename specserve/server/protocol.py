"""The wire format: the request bodies of /v1/completions, /v1/chat/completions and
/generate as pydantic models, OpenAI-style errors, server-sent events, and the translation
of an OpenAI request into the engine's sampling-params dict (SGLang's keys).

Models validate strictly (a string where a number belongs is an error, as in OpenAI's
API); unknown fields of the OpenAI bodies are ignored, as OpenAI-compatible servers do.
"""
from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from specserve.errors import EngineFatalError
from specserve.request.sampling_params import INT64_MAX, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from specserve.server.response_format import ResponseFormat
from specserve.server.sglang_fields import SGLangGenerateExtras, warn_once
from specserve.server.tool_specs import NamedToolChoice, ToolSpec, check_tool_choice

logger = logging.getLogger("specserve")
SSE_DONE = b"data: [DONE]\n\n"
# the step loop searches the text's last len(longest stop string) characters for every stop
# string at every token a request commits: a bound keeps one request from slowing every step
MAX_STOP_STRING_CHARS = 1024
INTERNAL_ERROR_MESSAGE = "internal server error (the server's log has the details)"
# every integer a request carries fits an int64 (the sampler's tensors hold them as such)
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class APIError(Exception):
    """A request the server refuses; rendered as OpenAI's error JSON with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def error_event(error: BaseException, engine_stopped: bool = False) -> bytes:
    """An error after a stream's headers went out: an error event, as vLLM and SGLang send."""
    return sse(client_error(error, engine_stopped).body())


def client_error(error: BaseException, engine_stopped: bool = False) -> APIError:
    """What a client is told about `error`: an APIError as it is; the engine's end as a 503
    (`engine_stopped`: whatever the request failed with, the engine has stopped); anything
    else, a bug or a failure inside the engine, as a generic 500 whose traceback is logged,
    so that no internal detail (class names, paths, ...) reaches the client."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineFatalError) or engine_stopped:
        return APIError(str(error), 503, type="server_error")
    logger.error("request failed", exc_info=error)
    return APIError(INTERNAL_ERROR_MESSAGE, 500, type="server_error")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    """Fields /v1/completions and /v1/chat/completions share, plus the SGLang/vLLM extensions."""
    model: str | None = None
    max_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)       # 0 keeps only the likeliest token: greedy
    n: Int64 = 1
    stop: str | list[str] | None = None
    seed: Count | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions, as SGLang and vLLM accept them
    top_k: Int64 | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    response_format: ResponseFormat | None = None
    # SGLang's structured-output extensions of the OpenAI bodies
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        check_stop_strings(stop)
        return stop

    @model_validator(mode="after")
    def _check_common(self):
        if self.n != 1:
            raise ValueError(f"only n=1 is supported, got n={self.n}")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The engine's sampling-params dict; keys left unset keep the engine's defaults."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens, "min_new_tokens": min(self.min_tokens, max_new_tokens),
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        optional = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed, "top_k": self.top_k,
                    "min_p": self.min_p, "repetition_penalty": self.repetition_penalty, "stop": self.stop,
                    "stop_token_ids": self.stop_token_ids, "regex": self.regex, "ebnf": self.ebnf}
        params.update({key: value for key, value in optional.items() if value is not None})
        if self.response_format is not None:
            params.update(self.response_format.grammar_params())
        return params


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16          # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"only best_of=1 is supported, got best_of={self.best_of}")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported (prompt logprobs)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a string or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_content(self):
        # as OpenAI: only an assistant message that carries tool calls may leave content out
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a message with role {self.role!r} must have content")
        return self

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        optional = {"tool_calls": self.tool_calls, "tool_call_id": self.tool_call_id, "name": self.name}
        message.update({key: value for key, value in optional.items() if value is not None})
        return message


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self):
        check_tool_choice(self.tools, self.tool_choice, self.response_format)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class GenerateRequest(SGLangGenerateExtras):
    """SGLang's native /generate body. The fields SGLang has and we lack are accepted and
    ignored (sglang_fields.py, a warning when one asks for something); any other unknown
    field is an error: this API is SGLang's, not an open-ended one."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)
    text: str | list[str] | None = None
    input_ids: list[TokenId] | list[list[TokenId]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    logprob_start_len: Int64 = Field(-1, ge=-1)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    input_embeds: Any = None      # as SGLang: text or input_ids win over it; alone, it is refused

    @field_validator("sampling_params")
    @classmethod
    def _check_stop(cls, sampling_params):
        for params in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
            stop = (params or {}).get("stop")
            if isinstance(stop, (str, list)):   # another type is the engine's to refuse
                check_stop_strings(stop, "sampling_params.stop")
        return sampling_params

    @field_validator("return_logprob", "top_logprobs_num", "logprob_start_len", mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        # SGLang declares these Optional (null = its default) and clients send null
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _check_generate(self):
        if self.text is None and self.input_ids is None and self.input_embeds is not None:
            raise ValueError("input_embeds is not supported: pass text or input_ids")
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("pass exactly one of text and input_ids")
        if self.stream and self.batch_size is not None:
            raise ValueError("stream=true takes a single prompt")
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != (self.batch_size or 1):
            raise ValueError("sampling_params must be one dict, or one per prompt")
        if self.return_logprob and self.logprob_start_len != -1:
            warn_once("logprob_start_len", self.logprob_start_len)   # prompt logprobs: not computed
        return self

    @property
    def batch_size(self) -> int | None:
        """None for a single prompt, else the number of prompts."""
        if isinstance(self.text, list):
            return len(self.text)
        if self.input_ids and isinstance(self.input_ids[0], list):
            return len(self.input_ids)
        return None


def check_stop_strings(stop: str | list | None, name: str = "stop") -> None:
    """ValueError unless there are at most MAX_STOP_STRINGS stop strings, each non-empty and
    at most MAX_STOP_STRING_CHARS long."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"{name}: at most {MAX_STOP_STRINGS} stop strings are allowed; got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError(f"{name}: stop strings must not be empty")
    longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"{name}: a stop string may be at most {MAX_STOP_STRING_CHARS} characters long; "
                         f"one has {longest}")


def finish_reason(reason: dict | None) -> str | None:
    """The engine's finish_reason dict -> OpenAI's string."""
    if reason is None:
        return None
    return "length" if reason["type"] == "length" else "stop" if reason["type"] == "stop" else reason["type"]


def matched_stop(reason: dict | None) -> int | str | None:
    return reason.get("matched") if reason else None
