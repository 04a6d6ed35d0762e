"""The request types every floor shares: a request, its batch and its speculative statistics
(req.py), its sampling parameters, the grammar it asked for (grammar_spec.py) and its
incremental detokenizer. They import nothing of the engine, the runner or the drafters."""
