"""Structured output: grammars (JSON schemas, regexes, EBNF, structural tags) compiled to
token bitmasks with xgrammar, a matcher per request, and the masks applied to the logits
of every draft-tree node before verification, so that constrained decoding stays exact
under speculation."""
