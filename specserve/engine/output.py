"""OutputTracker: turns committed tokens into the dicts callers receive (SGLang's shape)
and delivers them to each request's sink. Runs in the engine's step-loop thread."""
from __future__ import annotations

import time
from typing import Any, Callable

from specserve.request.req import Req


class OutputTracker:
    def __init__(self, engine, done_marker: object):
        self.engine = engine
        self.done = done_marker
        self.sinks: dict[str, tuple[Req, Callable[[Any], None], bool]] = {}
        self.sent: dict[str, tuple[int, int]] = {}     # rid -> (text chars sent, ids sent)

    def track(self, req: Req, sink: Callable[[Any], None], stream: bool) -> None:
        self.sinks[req.rid] = (req, sink, stream)
        self.sent[req.rid] = (0, 0)
        if req.finished:  # e.g. max_new_tokens=0
            self._send(req, final=True)

    def publish(self, outputs) -> None:
        for out in outputs:
            if out.req.rid in self.sinks:
                self._send(out.req, final=out.finished)

    def publish_final(self, req: Req) -> None:
        """The last output of a request that finished outside a step's outputs (aborted, or
        finished by a step that then failed)."""
        if req.rid in self.sinks:
            self._send(req, final=True)

    def fail(self, reqs: list[Req], error: Exception) -> None:
        """Fails and aborts these requests (their step raised)."""
        for req in reqs:
            self.engine.core.abort(req.rid)
            self._fail(req, error)

    def fail_all(self, error: Exception) -> None:
        for req, _, _ in list(self.sinks.values()):
            self.engine.core.abort(req.rid)
            self._fail(req, error)

    def _fail(self, req: Req, error: Exception) -> None:
        entry = self.sinks.pop(req.rid, None)
        self.sent.pop(req.rid, None)
        if entry is not None:
            entry[1](RuntimeError(f"request {req.rid} failed: {error}"))

    def _send(self, req: Req, final: bool) -> None:
        _, sink, stream = self.sinks[req.rid]
        if stream:
            sink(self._chunk(req, final))
        elif final:
            sink(self._full(req))
        if final:
            sink(self.done)
            del self.sinks[req.rid]
            del self.sent[req.rid]

    def _chunk(self, req: Req, final: bool) -> dict:
        """The text and ids that are new since the last chunk. While running, text that could
        still turn out to start a stop string is held back."""
        text_sent, ids_sent = self.sent[req.rid]
        text = req.detokenizer.text
        hold = 0 if final else max((len(s) for s in req.params.stop), default=1) - 1
        text_end = max(text_sent, len(text) - hold)
        self.sent[req.rid] = (text_end, len(req.output_ids))
        return {"text": text[text_sent:text_end], "output_ids": req.output_ids[ids_sent:],
                "meta_info": self._meta(req, ids_sent)}

    def _full(self, req: Req) -> dict:
        return {"text": req.detokenizer.text, "output_ids": list(req.output_ids), "meta_info": self._meta(req, 0)}

    def _meta(self, req: Req, logprobs_from: int) -> dict:
        end = req.finish_time or time.perf_counter()
        meta = {"id": req.rid, "prompt_tokens": len(req.prompt_ids), "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens, "finish_reason": req.finish_reason, "e2e_latency": end - req.arrival_time,
                "preemptions": req.preemptions}
        if req.first_token_time is not None:
            meta["ttft"] = req.first_token_time - req.arrival_time
        if self.engine.core.drafter is not None:
            meta["spec_verify_ct"] = req.spec.verify_steps
            meta["spec_accept_length"] = req.spec.accept_length
            meta["spec_accept_histogram"] = dict(sorted(req.spec.accept_length_histogram.items()))
            if req.spec.draft_sources:   # a hybrid drafter's (speculative/hybrid/)
                meta["spec_draft_sources"] = dict(req.spec.draft_sources)
        if req.return_logprob:
            ids = req.output_ids[logprobs_from:]
            meta["output_token_logprobs"] = [(lp, tok, None) for lp, tok in zip(req.output_logprobs[logprobs_from:], ids)]
            if req.top_logprobs_num:
                meta["output_top_logprobs"] = [[(lp, tok, None) for tok, lp in row]
                                               for row in req.output_top_logprobs[logprobs_from:]]
        return meta
