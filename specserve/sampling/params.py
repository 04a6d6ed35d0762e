"""SamplingParams: one request's sampling settings, validated on construction (SGLang's keys)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

_NUMBER = (int, float)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
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

    def __post_init__(self) -> None:
        _check_int(self, "max_new_tokens", low=0)
        _check_int(self, "min_new_tokens", low=0)
        _check_int(self, "top_k", low=-1)
        _check_int(self, "n", low=1, high=1)
        if self.seed is not None:
            _check_int(self, "seed", low=0)
        _check_number(self, "temperature", low=0.0)
        _check_number(self, "top_p", low=0.0, high=1.0, low_open=True)
        _check_number(self, "min_p", low=0.0, high=1.0)
        _check_number(self, "repetition_penalty", low=0.0, low_open=True)
        _check_number(self, "frequency_penalty", low=-2.0, high=2.0)
        _check_number(self, "presence_penalty", low=-2.0, high=2.0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        """Builds from a user dict; an unknown key is an error, never silently ignored."""
        params = dict(params or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        if "stop" in params:
            params["stop"] = _as_tuple(params["stop"], str, "stop")
            if any(s == "" for s in params["stop"]):
                raise ValueError("stop strings must not be empty")
        if "stop_token_ids" in params:
            params["stop_token_ids"] = _as_tuple(params["stop_token_ids"], int, "stop_token_ids")
        return cls(**params)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _as_tuple(value: Any, kind: type, name: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"{name} must be a {kind.__name__} or a list of {kind.__name__}, got {value!r}")


def _check_int(params: SamplingParams, name: str, low: int | None = None, high: int | None = None) -> None:
    value = getattr(params, name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value}")


def _check_number(params: SamplingParams, name: str, low: float, high: float | None = None, low_open: bool = False) -> None:
    value = getattr(params, name)
    if not isinstance(value, _NUMBER) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high if high is not None else 'inf'}], got {value}")
