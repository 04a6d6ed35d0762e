"""GrammarCache: grammars compiled for one tokenizer's vocabulary, cached by (kind, text).

Compiling a JSON schema for a 50k-150k vocabulary takes milliseconds to a second; requests
of one application send the same few schemas, so each is compiled once. Compiling runs on
the caller's thread (Engine.generate, the server's request thread), never in the step loop.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

from specserve.grammar.matcher import RequestGrammar
from specserve.request.grammar_spec import GrammarSpec, first_line

# whitespace characters a JSON schema allows between two tokens of JSON: enough for any
# indentation a model writes, and a small model cannot loop on newlines until max_new_tokens
MAX_WHITESPACE = 24


class GrammarCache:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_entries: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size        # the model's (its logits' width), may exceed the tokenizer's
        self.stop_token_ids = sorted(stop_token_ids)   # what ends a grammar's output (the model's eos)
        self._stop_set = frozenset(stop_token_ids)      # ... as each matcher asks it
        self.max_entries = max_entries
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        """A fresh matcher for one request; ValueError naming the field if the grammar is bad."""
        return RequestGrammar(self.compile(spec), self.vocab_size, self._stop_set)

    def compile(self, spec: GrammarSpec) -> Any:
        with self._lock:
            compiled = self._compiled.get(spec.cache_key)
            if compiled is not None:
                self._compiled.move_to_end(spec.cache_key)
                return compiled
            compiler = self._compiler_now()
        try:   # outside the lock: another request's cached grammar need not wait for this one
            compiled = _COMPILE[spec.kind](compiler, spec.text)
        except Exception as error:
            raise ValueError(f"{spec.kind} could not be compiled: {first_line(error)}") from None
        with self._lock:
            self._compiled[spec.cache_key] = compiled
            while len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)

    def _compiler_now(self):
        """Built on first use (~0.2 s for a 50k vocabulary): engines without grammars skip it."""
        if self._compiler is None:
            import xgrammar
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids)
            # xgrammar's own cache is off: this class keeps the compiled grammars
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler


_COMPILE = {
    "json_schema": lambda compiler, text: compiler.compile_json_schema(text, max_whitespace_cnt=MAX_WHITESPACE),
    "regex": lambda compiler, text: compiler.compile_regex(text),
    "ebnf": lambda compiler, text: compiler.compile_grammar(text),
    "structural_tag": lambda compiler, text: compiler.compile_structural_tag(text),
}
