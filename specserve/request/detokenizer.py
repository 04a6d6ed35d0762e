"""Incremental detokenization and stop-string matching across token boundaries.

Decoding the whole output every step costs O(length); instead (as vLLM does) keep two
offsets into the ids: text is re-decoded from `prefix_offset` only, and a new piece is
emitted once it no longer ends in an incomplete UTF-8 sequence ("\ufffd"); at finish the
text held back is emitted without such a tail.

Tokens a step commits together (a drafting step's accepted path) are decoded together
(`add_many`, as SGLang's detokenizer does per step): two decodes a request a step instead of
two a token. At 64 requests committing 12 tokens each (SmolLM2's tokenizer, this dev CPU)
that is ~0.5 ms a step instead of ~3.1. Where the batch's text ends in an incomplete UTF-8
sequence the tokens go one by one, so the text a step leaves is what one-by-one adds give.

Each token costs two decodes of a few ids; transformers' `decode` wraps the Rust one in
~5 us of Python (argument conversion, batch checks, the clean-up switch), more than the
decode itself, so where that wrapper adds nothing the Rust tokenizer is called directly.
"""
from __future__ import annotations

import functools
from typing import Callable

_CONTEXT_TOKENS = 4   # prompt tokens decoded with the first piece, so its leading space is right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True,
                 stop_strings: tuple[str, ...] = (), keep_stop_string: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings
        self.keep_stop_string = keep_stop_string
        self.text = ""
        self.stopped = False
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop_window = max((len(s) for s in stop_strings), default=0)
        self._decode_ids = _direct_decode(tokenizer, skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Appends one token; returns the stop string this token completed, if any.
        `text` then ends before the stop string (or after it with keep_stop_string)."""
        self._ids.append(token_id)
        return self._emit()

    def add_many(self, token_ids: list[int]) -> str | None:
        """Appends tokens in order; returns the stop string the first of them to complete one
        completed (the tokens after it are not added). Without stop strings, and unless the
        text would end in an incomplete UTF-8 sequence, one decode pair for all of them."""
        if self.stop_strings or len(token_ids) == 1:
            for token_id in token_ids:
                if (stop := self.add(token_id)) is not None:
                    return stop
            return None
        before = len(self._ids)
        self._ids.extend(token_ids)
        self._emit()   # no stop strings: nothing to return
        if self._read_offset <= before:   # nothing emitted (held back at the end): one by one
            del self._ids[before:]
            for token_id in token_ids:
                self.add(token_id)
        return None

    def _emit(self) -> str | None:
        """Text of the ids past the read offset, unless it ends in an incomplete UTF-8
        sequence; the stop string it completed, if any."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        new_from = len(self.text)
        self.text += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._find_stop(new_from)

    def flush(self) -> None:
        """At finish: emit text still held back, less the incomplete UTF-8 sequence at its end
        (a character max_new_tokens cut, which decodes to "\ufffd"), as vLLM drops it."""
        if self.stopped:
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        held_text = self._decode(self._ids[self._prefix_offset:])[len(prefix_text):]
        self.text += held_text.rstrip("\ufffd")
        self._prefix_offset = self._read_offset = len(self._ids)

    def _find_stop(self, new_from: int) -> str | None:
        if not self.stop_strings:
            return None
        # a stop string may start in earlier text and end in the new piece
        search_from = max(0, new_from - self._stop_window + 1)
        hits = [(at, stop) for stop in self.stop_strings if (at := self.text.find(stop, search_from)) != -1]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[:at + (len(stop) if self.keep_stop_string else 0)]
        self.stopped = True
        return stop

    def _decode(self, ids: list[int]) -> str:
        if self._decode_ids is not None:
            return self._decode_ids(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _direct_decode(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's decode where transformers' decode returns exactly what it does: a
    fast tokenizer whose class keeps the stock `_decode` and that cleans up no spaces."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or tokenizer.clean_up_tokenization_spaces:
        return None
    if type(tokenizer)._decode is not PreTrainedTokenizerFast._decode:
        return None
    backend = tokenizer.backend_tokenizer
    return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
