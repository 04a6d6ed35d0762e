"""SamplingParams: one request's sampling settings, validated on construction (SGLang's keys)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from specserve.request.grammar_spec import GRAMMAR_FIELDS, GrammarSpec, grammar_spec, grammar_text
_NUMBER = (int, float)
INT64_MAX = 2 ** 63 - 1          # integers ride in int64 tensors (seeds, top-k, token ids)
# a request's stop conditions are checked at every token it commits, in the step loop that all
# requests share: their number is bounded so that one request cannot slow everyone's steps
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0               # 0 keeps only the likeliest token (OpenAI accepts it): greedy
    top_k: int = -1                  # -1 (or 0): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    # structured output (SGLang's fields), at most one: the output follows the grammar
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        _check_int(self, "max_new_tokens", low=0)
        _check_int(self, "min_new_tokens", low=0)
        _check_int(self, "top_k", low=-1)
        _check_int(self, "n", low=1, high=1)
        if self.seed is not None:
            _check_int(self, "seed", low=0)
        _check_number(self, "temperature", low=0.0)
        _check_number(self, "top_p", low=0.0, high=1.0)
        _check_number(self, "min_p", low=0.0, high=1.0)
        _check_number(self, "repetition_penalty", low=0.0, low_open=True)
        _check_number(self, "frequency_penalty", low=-2.0, high=2.0)
        _check_number(self, "presence_penalty", low=-2.0, high=2.0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be a non-empty string, got {_show(value)}")
        grammar_spec(self)   # at most one

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Builds from a user dict; an unknown key is an error, never silently ignored."""
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        if "stop" in params:
            params["stop"] = _as_tuple(params["stop"], str, "stop", MAX_STOP_STRINGS)
            if any(s == "" for s in params["stop"]):
                raise ValueError("stop strings must not be empty")
        if "stop_token_ids" in params:
            params["stop_token_ids"] = _as_tuple(params["stop_token_ids"], int, "stop_token_ids", MAX_STOP_TOKEN_IDS)
            if any(not 0 <= t <= INT64_MAX for t in params["stop_token_ids"]):
                raise ValueError(f"stop_token_ids must be in [0, {INT64_MAX}]")
        for name in GRAMMAR_FIELDS:
            if name in params:
                params[name] = grammar_text(name, params[name])
        return cls(**params)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1 or self.top_p == 0.0

    @property
    def grammar(self) -> GrammarSpec | None:
        return grammar_spec(self)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _as_tuple(value: Any, kind: type, name: str, max_items: int) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        if len(value) > max_items:
            raise ValueError(f"{name} holds {len(value)} items; at most {max_items} are allowed")
        return tuple(value)
    raise ValueError(f"{name} must be a {kind.__name__} or a list of {kind.__name__}, got {_show(value)}")


def _check_int(params: SamplingParams, name: str, low: int | None = None, high: int | None = None) -> None:
    value = getattr(params, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {_show(value)}")
    high = INT64_MAX if high is None else high
    if (low is not None and value < low) or value > high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {_show(value)}")


def _check_number(params: SamplingParams, name: str, low: float, high: float | None = None, low_open: bool = False) -> None:
    value = getattr(params, name)
    if not isinstance(value, _NUMBER) or isinstance(value, bool) or not _fits_float(value):
        raise ValueError(f"{name} must be a finite number, got {_show(value)}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high if high is not None else 'inf'}], got {_show(value)}")


def _fits_float(value: int | float) -> bool:
    """Whether the value is a finite float32 once in a tensor (an int like 10**400 is not)."""
    try:
        return math.isfinite(value) and abs(float(value)) <= _FLOAT32_MAX
    except OverflowError:
        return False


_FLOAT32_MAX = 3.4e38


def _show(value: Any) -> str:
    """A short rendering of a bad value (str() of a huge int is slow, or refused past 4300 digits)."""
    if isinstance(value, int) and abs(value) > INT64_MAX:
        return f"an integer of {value.bit_length()} bits"
    return f"{value!r:.100}"
