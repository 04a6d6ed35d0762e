"""Engine: the offline API (SGLang's `Engine` keywords and `generate` shape).

The EngineCore runs in its own thread; callers (sync, async, HTTP) hand it requests
through an inbox and receive their outputs through per-request sinks, so nothing a caller
does blocks the step loop.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import uuid
from typing import Any, Callable, Iterator

from specserve.args import ServerArgs
from specserve.engine.builder import build_core
from specserve.engine.failure_isolation import FailureIsolation
from specserve.engine.front import (DONE, EngineFront, RequestLimits, capped_max_new_tokens, check_request,
                                    last_result)
from specserve.engine.loop_mailbox import LoopMailboxes
from specserve.engine.output import OutputTracker
from specserve.errors import EngineFatalError
from specserve.grammar.compiler import GrammarCache
from specserve.request.detokenizer import IncrementalDetokenizer
from specserve.request.req import Req, ReqState

logger = logging.getLogger("specserve")
# the drafters whose steps verify through the sampler, which applies grammar masks to every node
# (model drafters' fused and chained steps verify on the device without them)
GRAMMAR_ALGORITHMS = ("NGRAM", "LOOKAHEAD")


class Engine(EngineFront):
    def __init__(self, model_path: str | None = None, **server_args: Any):
        self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        logging.basicConfig(level=self.args.log_level.upper(), format="[specserve %(asctime)s] %(message)s")
        self.core, self.tokenizer, self.model_path = build_core(self.args)
        runner = self.core.runner
        self.limits = RequestLimits(runner.config.vocab_size, runner.context_length, runner.pool.size)
        self.grammars = GrammarCache(self.tokenizer, runner.config.vocab_size, runner.config.eos_token_ids)
        self._rng = random.Random(self.args.random_seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._mailboxes = LoopMailboxes()   # async callers' outputs, delivered once per step
        # run on the step loop's thread once per pass of the loop, after a step's outputs went to their sinks
        self._flush_hooks: list[Callable[[], None]] = [self._mailboxes.wake_all]
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
        results = [last_result(_drain(sink)) for sink in sinks]
        return results[0] if single else results

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

    def load(self) -> dict:
        """Queue lengths and KV cache occupancy: plain reads of the step loop's state, from any thread."""
        return core_load(self.core)

    def add_request(self, input_ids: list[int], sampling_params: dict | None, sink: Callable[[Any], None],
                    stream: bool, return_logprob: bool = False, top_logprobs_num: int = 0, rid: str | None = None) -> None:
        """For a front that delivers outputs itself (the engine process's server): `sink` gets,
        on the step loop's thread, the request's outputs, then `DONE` (or an exception). A
        ValueError for bad input is raised here."""
        self._submit(self._make_request(input_ids, sampling_params, return_logprob, top_logprobs_num, rid), sink, stream)

    def add_flush_hook(self, hook: Callable[[], None]) -> None:
        """`hook()` runs on the step loop's thread once per pass of its loop, after the pass's
        outputs went to their sinks (where a front batches what its sinks collected)."""
        self._flush_hooks.append(hook)

    def get_server_info(self) -> dict:
        return {**{k: v for k, v in vars(self.args).items()}, "model_path": self.model_path,
                "chunked_prefill_size": self.core.runner.chunk_size,
                "context_length": self.context_length, "max_total_tokens": self.core.runner.pool.size,
                "max_total_num_tokens": self.core.runner.pool.size}   # SGLang's name: KV tokens that fit

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
    def _make_request(self, ids, params_dict, return_logprob, top_logprobs_num, rid) -> Req:
        params = check_request(ids, params_dict, top_logprobs_num, self.limits)
        eos = set() if params.ignore_eos else set(self.core.runner.config.eos_token_ids)
        grammar = self._grammar_matcher(params)
        max_new_tokens, cap_message = capped_max_new_tokens(len(ids), params.max_new_tokens, self.limits)
        if cap_message is not None:
            logger.warning("%s", cap_message)
        return Req(
            rid=rid or uuid.uuid4().hex, prompt_ids=list(ids), params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, params.stop, params.no_stop_trim),
            seed=params.seed if params.seed is not None else self._rng.getrandbits(62),
            stop_ids=frozenset(eos | set(params.stop_token_ids)),
            max_new_tokens=max_new_tokens, length_cap_message=cap_message,
            return_logprob=return_logprob or top_logprobs_num > 0, top_logprobs_num=top_logprobs_num,
            grammar=grammar)

    def _grammar_matcher(self, params):
        """The request's grammar matcher (compiled here, on the caller's thread, once per grammar)."""
        spec = params.grammar
        if spec is None:
            return None
        algorithm = self.args.speculative_algorithm
        if algorithm is not None and algorithm.upper() not in GRAMMAR_ALGORITHMS:
            raise ValueError(f"{spec.kind}: structured output is supported without speculation and with "
                             f"{' / '.join(GRAMMAR_ALGORITHMS)}, not with speculative_algorithm {algorithm}")
        return self.grammars.matcher(spec)

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

    # --- the step loop (its own thread) ---
    def _loop(self) -> None:
        tracker = OutputTracker(self, DONE)
        try:
            self._run_steps(tracker, FailureIsolation(self.core, tracker))
        finally:
            self._flush_outputs()   # the last outputs (failures, the shutdown's)

    def _run_steps(self, tracker: OutputTracker, isolation: FailureIsolation) -> None:
        while not self._stopped:
            self._drain_inbox(tracker)
            self._flush_outputs()   # the last step's outputs and the inbox's: one wake-up per loop
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

    def _flush_outputs(self) -> None:
        for hook in self._flush_hooks:
            hook()

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


def core_load(core) -> dict:
    """Cached prefixes no running request holds count as free (they are evicted on demand)."""
    scheduler = core.scheduler
    free, total = scheduler.available_slots(), core.runner.pool.size
    return {"num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
            "kv_free_slots": free, "kv_total_slots": total, "kv_usage": 1.0 - free / total if total else 0.0,
            "kv_cached_slots": scheduler.cached_slots(), **core.spec_counters.as_dict()}


def _drain(sink: queue.SimpleQueue) -> Iterator[dict]:
    while True:
        item = sink.get()
        if item is DONE:
            return
        if isinstance(item, Exception):
            raise item
        yield item
