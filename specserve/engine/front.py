"""EngineFront: what the in-process Engine and the EngineProcess client (the engine in a
child process) share, so that a caller (the HTTP server) cannot tell them apart:
`async_generate`'s arguments turned into checked requests with the same errors, the stream
of a request's outputs through an asyncio queue that LoopMailboxes fills once per step, and
the chat template. A subclass says how a request is built and submitted, and how it is aborted.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from specserve.engine.loop_mailbox import LoopMailboxes
from specserve.request.grammar_spec import check_grammar
from specserve.request.sampling_params import SamplingParams

DONE = object()   # a request's last item in its sink: no output follows


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against before it reaches the step loop."""
    vocab_size: int
    context_length: int
    kv_slots: int        # the whole KV cache: a longer prompt can never run


class EngineFront:
    tokenizer: Any
    limits: RequestLimits
    _mailboxes: LoopMailboxes

    # --- what a subclass provides ---
    def _make_request(self, ids: list[int], params_dict: dict | None, return_logprob: bool,
                      top_logprobs_num: int, rid: str | None) -> Any:
        """A request (with `rid` and `finished`), its inputs checked by `check_request`."""
        raise NotImplementedError

    def _submit(self, req: Any, sink: Callable[[Any], None], stream: bool) -> None:
        """Hands `req` to the step loop; its outputs, an exception or DONE go to `sink`."""
        raise NotImplementedError

    def abort_request(self, rid: str) -> None:
        raise NotImplementedError

    # --- shared ---
    @property
    def context_length(self) -> int:
        return self.limits.context_length

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             top_logprobs_num=0, stream=False, rid=None):
        """One dict per prompt (a list for a list of prompts); with stream=True, an async
        iterator of incremental chunks that submits the request when first advanced."""
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._async_stream(reqs[0])
        results = await asyncio.gather(*(self._async_one(req) for req in reqs))
        return results[0] if single else list(results)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """tools: OpenAI function tools, for templates that describe them to the model."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _make_requests(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid):
        """(requests, whether a single prompt was given); ValueError naming what is wrong."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and (not input_ids or isinstance(input_ids[0], int)))
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            id_lists = [self._encode(p) for p in prompts]
        else:
            id_lists = [input_ids] if single else input_ids
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(id_lists)
        if len(params) != len(id_lists):
            raise ValueError(f"got {len(params)} sampling_params for {len(id_lists)} prompts")
        rids = rid if isinstance(rid, list) else [rid] * len(id_lists)
        reqs = [self._make_request(ids, p, return_logprob, top_logprobs_num, r) for ids, p, r in zip(id_lists, params, rids)]
        return reqs, single

    def _encode(self, prompt: str) -> list[int]:
        if prompt == "":
            raise ValueError("prompt must not be empty")
        return self.tokenizer(prompt).input_ids

    async def _async_one(self, req: Any) -> dict:
        result = None
        # closed at once when this is cancelled (its caller left), so the abort is sent now
        async with contextlib.aclosing(self._async_stream(req, stream=False)) as items:
            async for item in items:
                result = item
        return last_result([result])

    async def _async_stream(self, req: Any, stream: bool = True) -> AsyncIterator[dict]:
        sink: asyncio.Queue = asyncio.Queue()
        mailbox = self._mailboxes.of(asyncio.get_running_loop())   # one loop wake-up per step, not per request
        self._submit(req, functools.partial(mailbox.post, sink), stream)
        try:
            while True:
                item = await sink.get()
                if item is DONE:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not req.finished:
                self.abort_request(req.rid)


def check_request(ids: Any, params_dict: Any, top_logprobs_num: Any, limits: RequestLimits) -> SamplingParams:
    """The request's SamplingParams, or a ValueError naming the field that is wrong."""
    if params_dict is not None and not isinstance(params_dict, dict):
        raise ValueError(f"sampling_params must be a dict, got {type(params_dict).__name__}")
    params = SamplingParams.from_dict(params_dict)
    vocab = limits.vocab_size
    if not isinstance(ids, list) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise ValueError(f"input_ids must be integers in [0, {vocab})")
    if len(ids) >= limits.context_length:
        raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {limits.context_length}")
    if len(ids) + 1 > limits.kv_slots:
        raise ValueError(f"the prompt has {len(ids)} tokens; the KV cache holds {limits.kv_slots}")
    if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top_logprobs_num!r}")
    if params.grammar is not None:
        check_grammar(params.grammar)
    return params


def capped_max_new_tokens(prompt_len: int, asked: int, limits: RequestLimits) -> tuple[int, str | None]:
    """max_new_tokens capped by the context and by the whole KV cache (a longer request would
    preempt itself forever), and where the cache is what cut it, a message saying so: the
    context's cap is the model's (as in SGLang and vLLM, silent), the cache's is a setting."""
    context_room = limits.context_length - prompt_len
    kv_room = limits.kv_slots + 1 - prompt_len   # the last token generated needs no slot
    if kv_room >= min(asked, context_room):
        return min(asked, context_room), None
    return kv_room, (f"max_new_tokens {asked} cut to {kv_room}: the KV cache holds {limits.kv_slots} tokens "
                     f"(max_total_tokens) and the prompt takes {prompt_len}; raise --max-total-tokens or lower "
                     "max_new_tokens")


def last_result(items) -> dict:
    items = list(items)
    if not items or items[-1] is None:
        raise RuntimeError("the request produced no output")
    return items[-1]
