"""GrammarSpec: which grammar a request asked for (the sampling-param field and its text),
and its check before the request reaches the engine (no tokenizer needed)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# SGLang's sampling-param fields that constrain the output, at most one per request
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# OpenAI's response_format {"type": "json_object"}: any JSON object
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class GrammarSpec:
    kind: str    # one of GRAMMAR_FIELDS
    text: str    # the schema / structural tag as JSON text, the regex, the EBNF grammar

    @property
    def cache_key(self) -> tuple[str, str]:
        return self.kind, self.text


def grammar_text(name: str, value: Any) -> str | None:
    """A grammar field's value as text: JSON schemas and structural tags may come as dicts."""
    if value is None:
        return None
    if name in ("json_schema", "structural_tag") and isinstance(value, dict):
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, got {value!r:.100}")
    return value


def grammar_spec(params: Any) -> GrammarSpec | None:
    """The grammar of a SamplingParams (None: unconstrained); ValueError if several are set."""
    given = [(name, getattr(params, name)) for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if len(given) > 1:
        raise ValueError(f"at most one of {', '.join(GRAMMAR_FIELDS)} may be set, got {[n for n, _ in given]}")
    return GrammarSpec(*given[0]) if given else None


def check_grammar(spec: GrammarSpec) -> None:
    """Parses the grammar (xgrammar, without a tokenizer): a ValueError naming the field when
    it is not a valid one. Compiling it for a vocabulary (grammar/compiler.py) gives the same verdict.
    A grammar found valid is not parsed again: requests of one application send the same few,
    and a structural tag's parse takes ~3 ms on the request's thread, beside the engine's."""
    _checked(spec.kind, spec.text)


@lru_cache(maxsize=1024)   # a bad grammar raises, which is not cached: it is refused every time
def _checked(kind: str, text: str) -> None:
    import xgrammar   # lazily: an engine that never sees a grammar never loads it
    parse = {"json_schema": xgrammar.Grammar.from_json_schema, "regex": xgrammar.Grammar.from_regex,
             "ebnf": xgrammar.Grammar.from_ebnf, "structural_tag": xgrammar.Grammar.from_structural_tag}[kind]
    try:
        if kind == "json_schema":
            json.loads(text)
        parse(text)
    except Exception as error:   # xgrammar raises RuntimeError / ValueError / its own kinds
        raise ValueError(f"{kind} is not a valid {_WHAT[kind]}: {first_line(error)}") from None


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar",
         "structural_tag": "structural tag"}


def first_line(error: BaseException) -> str:
    """xgrammar's messages start with a timestamp and a source location: keep what follows."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:300]
