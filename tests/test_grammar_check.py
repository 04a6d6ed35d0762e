"""check_grammar: a grammar found valid is parsed once, whatever number of requests send it; a
bad one is refused every time, with a ValueError naming its field."""
from __future__ import annotations

import pytest
import xgrammar

from specserve.request.grammar_spec import GrammarSpec, check_grammar


def test_a_valid_grammar_is_parsed_once_and_a_bad_one_refused_every_time(monkeypatch):
    parsed = []
    from_regex = xgrammar.Grammar.from_regex
    monkeypatch.setattr(xgrammar.Grammar, "from_regex", lambda text: parsed.append(text) or from_regex(text))
    good, bad = GrammarSpec("regex", r"(yes|no) \d{1,3}\."), GrammarSpec("regex", "(unclosed")
    for _ in range(3):
        check_grammar(good)
        with pytest.raises(ValueError, match="^regex is not a valid regular expression"):
            check_grammar(bad)
    assert parsed.count(good.text) == 1 and parsed.count(bad.text) == 3
