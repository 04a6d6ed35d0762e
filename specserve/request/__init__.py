"""The request types every floor shares: a request, its batch and its speculative statistics
(req.py), its sampling parameters and its incremental detokenizer. They import nothing of
the engine, the runner or the drafters."""
