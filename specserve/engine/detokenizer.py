"""Incremental detokenization and stop-string matching across token boundaries.

Decoding the whole output every step costs O(length); instead (as vLLM does) keep two
offsets into the ids: text is re-decoded from `prefix_offset` only, and a new piece is
emitted once it no longer ends in an incomplete UTF-8 sequence ("\ufffd").
"""
from __future__ import annotations

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

    def add(self, token_id: int) -> str | None:
        """Appends one token; returns the stop string this token completed, if any.
        `text` then ends before the stop string (or after it with keep_stop_string)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        new_from = len(self.text)
        self.text += new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._find_stop(new_from)

    def flush(self) -> None:
        """At finish: emit text still held back (an incomplete byte sequence at the end)."""
        if self.stopped:
            return
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self.text += self._decode(self._ids[self._prefix_offset:])[len(prefix_text):]
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
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
