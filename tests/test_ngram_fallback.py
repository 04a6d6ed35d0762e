"""Without a C compiler, NGRAM still works: NgramTrie(config) gives the pure-Python trie
(tests/test_ngram_trie.py checks it behaves as the compiled one), with one warning."""
from __future__ import annotations

import logging

import pytest

from specserve.speculative.ngram import trie as ngram_trie
from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.trie_py import PythonNgramTrie

TOKENS = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8, 1, 2]


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))   # nothing compiled there yet
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(ngram_trie.shutil, "which", lambda name: None)
    ngram_trie._library.cache_clear()
    ngram_trie.compiled_trie_unavailable.cache_clear()
    yield
    ngram_trie._library.cache_clear()
    ngram_trie.compiled_trie_unavailable.cache_clear()


def test_without_a_compiler_the_python_trie_stands_in_with_one_warning(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger="specserve"):
        first = ngram_trie.NgramTrie(NgramConfig(capacity=1000))
        second = ngram_trie.NgramTrie(NgramConfig(capacity=1000))
    assert isinstance(first, PythonNgramTrie) and isinstance(second, PythonNgramTrie)
    warnings = [r.getMessage() for r in caplog.records if "pure-Python" in r.getMessage()]
    assert len(warnings) == 1 and "no C compiler" in warnings[0]
    first.insert(TOKENS, owner=1)
    assert first.propose([5, 6], 3, True, owner=1) == ([7, 8], [-1, 0])   # the owner's own continuation


def test_with_a_compiler_the_trie_is_compiled():
    assert ngram_trie.compiled_trie_unavailable() is None
    assert isinstance(ngram_trie.NgramTrie(NgramConfig(capacity=1000)), ngram_trie.NgramTrie)
