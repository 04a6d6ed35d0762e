"""Engine: the offline API (SGLang's `Engine` keywords and `generate` shape).

The EngineCore runs in its own thread; callers (sync, async, HTTP) hand it requests
through an inbox and receive their outputs through per-request sinks, so nothing a caller
does blocks the step loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import random
import threading
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

from specserve.args import ServerArgs
from specserve.engine.builder import build_core
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.failure_isolation import FailureIsolation
from specserve.engine.loop_mailbox import LoopMailboxes
from specserve.engine.output import OutputTracker
from specserve.engine.request import Req, ReqState
from specserve.errors import EngineFatalError
from specserve.sampling.params import SamplingParams

logger = logging.getLogger("specserve")
_DONE = object()


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        logging.basicConfig(level=self.args.log_level.upper(), format="[specserve %(asctime)s] %(message)s")
        self.core, self.tokenizer, self.model_path = build_core(self.args)
        self.context_length = self.core.runner.context_length
        self._rng = random.Random(self.args.random_seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._mailboxes = LoopMailboxes()   # async callers' outputs, delivered once per step
        self._stopped = False
        self._fatal: EngineFatalError | None = None   # set once a step says no further step can run
        self._thread = threading.Thread(target=self._loop, name="specserve-core", daemon=True)
        self._thread.start()

    # --- the offline API ---
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 top_logprobs_num: int = 0, stream: bool = False, rid: str | list[str] | None = None):
        """Returns one dict per prompt (a list for a list of prompts); with stream=True, an
        iterator of incremental chunks (`text` and `output_ids` hold what is new)."""
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(reqs[0])
        sinks = [queue.SimpleQueue() for _ in reqs]
        for req, sink in zip(reqs, sinks):
            self._submit(req, sink.put, stream=False)
        results = [_last_result(_drain(sink)) for sink in sinks]
        return results[0] if single else results

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             top_logprobs_num=0, stream=False, rid=None):
        reqs, single = self._make_requests(prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return self._async_stream(reqs[0])
        results = await asyncio.gather(*(self._async_one(req) for req in reqs))
        return results[0] if single else list(results)

    def abort_request(self, rid: str) -> None:
        self._inbox.put(("abort", rid))
        self._wake.set()

    def flush_cache(self) -> int:
        """Drops every cached prefix no running request holds (SGLang's Engine.flush_cache);
        returns the KV slots freed. Runs on the step loop's thread, between steps."""
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put(("flush", done.put))
        self._wake.set()
        return done.get(timeout=60)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def get_server_info(self) -> dict:
        return {**{k: v for k, v in vars(self.args).items()}, "model_path": self.model_path,
                "context_length": self.context_length, "max_total_tokens": self.core.runner.pool.size}

    @property
    def fatal_error(self) -> EngineFatalError | None:
        """Why the engine stopped taking steps (a tensor-parallel rank died, say), if it did."""
        return self._fatal

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.core.runner.shutdown()   # tensor-parallel worker processes, if any
        if self.core.drafter is not None:
            self.core.drafter.close()   # e.g. the n-gram trie's writer thread

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    # --- requests ---
    def _make_requests(self, prompt, input_ids, sampling_params, return_logprob, top_logprobs_num, rid):
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

    def _make_request(self, ids, params_dict, return_logprob, top_logprobs_num, rid) -> Req:
        if params_dict is not None and not isinstance(params_dict, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params_dict).__name__}")
        params = SamplingParams.from_dict(params_dict)
        vocab = self.core.runner.config.vocab_size
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"input_ids must be integers in [0, {vocab})")
        if len(ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context length is {self.context_length}")
        if len(ids) + 1 > self.core.runner.pool.size:
            raise ValueError(f"the prompt has {len(ids)} tokens; the KV cache holds {self.core.runner.pool.size}")
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be a non-negative integer, got {top_logprobs_num!r}")
        eos = set() if params.ignore_eos else set(self.core.runner.config.eos_token_ids)
        return Req(
            rid=rid or uuid.uuid4().hex, prompt_ids=list(ids), params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop, params.no_stop_trim),
            seed=params.seed if params.seed is not None else self._rng.getrandbits(62),
            stop_ids=frozenset(eos | set(params.stop_token_ids)),
            # capped by the context and by the whole cache: a longer request would preempt itself forever
            max_new_tokens=min(params.max_new_tokens, self.context_length - len(ids),
                               self.core.runner.pool.size + 1 - len(ids)),
            return_logprob=return_logprob or top_logprobs_num > 0, top_logprobs_num=top_logprobs_num)

    def _submit(self, req: Req, sink: Callable[[Any], None], stream: bool) -> None:
        if self._fatal is not None:
            raise EngineFatalError(f"the engine stopped: {self._fatal}")
        if self._stopped:
            raise RuntimeError("the engine has been shut down")
        self._inbox.put(("add", req, sink, stream))
        self._wake.set()

    def _stream(self, req: Req) -> Iterator[dict]:
        sink: queue.SimpleQueue = queue.SimpleQueue()
        self._submit(req, sink.put, stream=True)
        try:
            for item in _drain(sink):
                yield item
        finally:
            if not req.finished:
                self.abort_request(req.rid)

    async def _async_one(self, req: Req) -> dict:
        result = None
        # closed at once when this is cancelled (its caller left), so the abort is sent now
        async with contextlib.aclosing(self._async_stream(req, stream=False)) as items:
            async for item in items:
                result = item
        return _last_result([result])

    async def _async_stream(self, req: Req, stream: bool = True) -> AsyncIterator[dict]:
        sink: asyncio.Queue = asyncio.Queue()
        mailbox = self._mailboxes.of(asyncio.get_running_loop())   # one loop wake-up per step, not per request
        self._submit(req, functools.partial(mailbox.post, sink), stream)
        try:
            while True:
                item = await sink.get()
                if item is _DONE:
                    return
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            if not req.finished:
                self.abort_request(req.rid)

    # --- the step loop (its own thread) ---
    def _loop(self) -> None:
        tracker = OutputTracker(self, _DONE)
        try:
            self._run_steps(tracker, FailureIsolation(self.core, tracker))
        finally:
            self._mailboxes.wake_all()   # the last outputs (failures, the shutdown's)

    def _run_steps(self, tracker: OutputTracker, isolation: FailureIsolation) -> None:
        while not self._stopped:
            self._drain_inbox(tracker)
            self._mailboxes.wake_all()   # the last step's outputs and the inbox's: one wake-up per loop
            if not self.core.has_work():
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                isolation.step()
            except EngineFatalError as error:
                logger.error("the engine cannot go on: %s", error)
                self._fatal = error   # new requests are refused; shutdown() still reaps the runner's processes
                self._drain_inbox(tracker)   # requests submitted meanwhile fail with the rest
                tracker.fail_all(error)
                return
        tracker.fail_all(RuntimeError("the engine was shut down"))

    def _drain_inbox(self, tracker: OutputTracker) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "add":
                _, req, sink, stream = message
                try:
                    self.core.add_request(req)
                except Exception as error:
                    # finished, so the caller's clean-up never aborts a live request of the same rid
                    req.state = ReqState.FINISHED
                    sink(error)
                    continue
                tracker.track(req, sink, stream)
            elif message[0] == "flush":
                message[1](self.core.scheduler.flush_cache())
            else:
                req = self.core.abort(message[1])
                if req is not None:
                    tracker.publish_final(req)


def _drain(sink: queue.SimpleQueue) -> Iterator[dict]:
    while True:
        item = sink.get()
        if item is _DONE:
            return
        if isinstance(item, Exception):
            raise item
        yield item


def _last_result(items) -> dict:
    items = list(items)
    if not items or items[-1] is None:
        raise RuntimeError("the request produced no output")
    return items[-1]
