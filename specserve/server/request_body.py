"""Reading and decoding request bodies with limits, so that no body can cost the server
more than a bounded amount of memory, stack or time: a size cap (413), a nesting cap
(400), and JSON's own rules (no NaN, no Infinity, no number that overflows a float).

JSON may spell a lone UTF-16 surrogate (`"\ud800"`: a JavaScript client that cut a string
inside an emoji sends one). Python decodes it into a string that cannot be encoded as UTF-8,
so the tokenizer, the chat template and even an error message echoing it would fail; such
a string is refused here, naming the field, before anything else sees it.

Python's json module recurses once per nesting level and would raise RecursionError on a
deeply nested body; pydantic and `repr` recurse too. Bodies this API accepts nest a few
levels (a message's content parts inside messages), so anything deeper than
MAX_JSON_DEPTH is refused before any of them sees it.
"""
from __future__ import annotations

import difflib
import json
import math
import re
import reprlib
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from specserve.server.protocol import APIError

Body = TypeVar("Body", bound=BaseModel)

MAX_BODY_BYTES = 16 * 1024 * 1024   # a /generate batch of 64 prompts of 64k tokens fits
MAX_JSON_DEPTH = 64
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body's bytes; 413 once it exceeds `limit` (before reading it when the client
    announces its length)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than {limit} bytes", status=413, code="request_too_large")


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """JSON bytes -> a validated request model, or an APIError naming the bad field."""
    data = decode_json(raw)
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        field = ".".join(str(part) for part in first["loc"] if isinstance(part, int) or "[" not in str(part))
        if first["type"] == "missing":
            message = f"missing required field {field!r}"
        elif first["type"] == "extra_forbidden":
            message = f"unknown field {field!r}" + _did_you_mean(field.rpartition(".")[2], model)
        elif first["type"].startswith("value_error"):
            message = str(first["msg"]).removeprefix("Value error, ")
        else:
            message = f"invalid value for {field!r}: {first['msg']} (got {_short_repr(first.get('input'))})"
        raise APIError(message, param=str(first["loc"][0]) if first["loc"] else None) from None


def _did_you_mean(name: str, model: type[BaseModel]) -> str:
    close = difflib.get_close_matches(name, model.model_fields, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _short_repr(value: Any) -> str:
    """A repr that costs little whatever the value's size (a prompt of megabytes, say)."""
    short = reprlib.Repr()
    short.maxlevel, short.maxstring, short.maxother, short.maxlong, short.maxlist, short.maxdict = 3, 100, 100, 40, 8, 8
    return short.repr(value)


def decode_json(raw: bytes) -> Any:
    """JSON bytes -> Python objects, or an APIError (400) saying what is wrong."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(f"the request body is not valid JSON: {error}") from None
    check_depth(data)
    return data


def check_depth(data: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raises APIError if lists/dicts nest deeper than `limit`, or if a string (a value or a
    key) holds a lone surrogate; iterative, so any depth is safe."""
    if isinstance(data, str):
        _check_text(data, ())
    level = [((), data)] if isinstance(data, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise _too_deep()
        children = []
        for path, container in level:
            items = container.items() if isinstance(container, dict) else enumerate(container)
            for key, value in items:
                if isinstance(key, str):   # first: a field name that holds one must not be echoed
                    _check_text(key, path, "a field name in ")
                if isinstance(value, (list, dict)):
                    children.append(((path, key), value))
                elif isinstance(value, str):
                    _check_text(value, (path, key))
        level = children


def _check_text(text: str, path: tuple, what: str = "") -> None:
    """`text.isascii()` is a flag read: only non-ASCII strings are searched."""
    if not text.isascii() and _SURROGATE.search(text):
        where = what + (_field_name(path) or "the request body")
        raise APIError(f"{where} holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff not paired "
                       "as a character); text must be valid Unicode", param=_top_field(path))


def _field_name(path: tuple) -> str:
    """("messages", 0, "content") nested as ((((), "messages"), 0), "content") -> messages[0].content"""
    parts = []
    while path:
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def _top_field(path: tuple) -> str | None:
    top = None
    while path:
        path, top = path
    return top if isinstance(top, str) else None


def _too_deep() -> APIError:
    return APIError(f"the request body nests lists/objects deeper than {MAX_JSON_DEPTH} levels")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value
