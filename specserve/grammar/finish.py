"""A constrained request's end: its matcher advanced with each committed token, and the
request finished once the grammar has ended (its stop token accepted)."""
from __future__ import annotations

import logging

logger = logging.getLogger("specserve")


def grammar_finish(req, token: int, reason: dict | None) -> dict | None:
    """Advances the request's matcher past `token`, just committed; returns the finish
    reason: `reason` (the usual checks'), else a stop once the grammar has ended (it ends
    only on a stop token: this finishes the request where ignore_eos or min_new_tokens kept
    the usual checks from ending it)."""
    if not req.grammar.accept(token):
        # cannot happen while every step applies the request's mask: say so rather than go on unconstrained
        logger.error("request %s: token %d is outside its grammar; the request ends here", req.rid, token)
        return reason or {"type": "abort", "message": f"token {token} is outside the request's grammar"}
    if reason is None and req.grammar.terminated:
        return {"type": "stop", "matched": token}
    return reason
