"""EngineProcess: the Engine in a child process, and the client the HTTP server talks to.

In one process, the server's event loop (uvicorn, handlers, one SSE chunk per token) and the
engine's step loop share one GIL: at 64 streams the HTTP thread held it ~2 ms per ~3.5 ms
GPU step, time the step loop waited. Here the engine runs in its own process (spawned: the
server's process never touches CUDA); the server keeps only the tokenizer, for tokenizing
and chat templates. (SGLang splits its server the same way.)

Wire: one duplex pipe, pickled tuples.
    server -> engine: ("add", key, rid, input_ids, sampling_params, return_logprob, top_logprobs_num, stream),
                      ("abort", rid), ("flush", token), ("shutdown",)
    engine -> server: ("ready", EngineInfo) or ("failed", exception), once, at start; then
                      ("step", [(key, item), ...], load, fatal_error): what a pass of the step
                      loop produced, in one message; ("flushed", token, slots freed or exception)
An item is an output dict, an exception, or None (the request's end). `key` is the client's
number for the request: outputs find their queue by it even when a caller reuses a rid.
The child's side is engine_worker.py.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.util
import queue
import signal
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from specserve.args import ServerArgs
from specserve.engine.engine_worker import EngineInfo, serve_engine
from specserve.engine.front import DONE, EngineFront, check_request
from specserve.engine.loop_mailbox import LoopMailboxes
from specserve.errors import EngineFatalError

logger = logging.getLogger("specserve")
STOP_TIMEOUT_S = 60.0   # the engine's own shutdown joins its step loop (30 s) and any tensor-parallel ranks


@dataclass(slots=True)
class RemoteRequest:
    key: int
    rid: str
    input_ids: list[int]
    sampling_params: dict | None
    return_logprob: bool
    top_logprobs_num: int
    finished: bool = False     # set by the reader thread at the request's last item


class EngineProcess(EngineFront):
    """Starts the engine process and blocks until the engine is built and warmed up; a
    failure there (a bad model path, say) is raised here, as Engine(...) would raise it."""

    def __init__(self, args: ServerArgs):
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        # not a daemon: a daemon may not start processes, and tensor-parallel ranks are processes
        self._process = context.Process(target=serve_engine, args=(args, child_end), name="specserve-engine")
        self._process.start()
        child_end.close()   # so that the child's exit is an EOF here
        self._send_lock = threading.Lock()
        # one waiter at a time: of two threads in waitpid, one gets ECHILD and takes the child for alive
        self._wait_lock = threading.Lock()
        # reaps the child even when nobody calls shutdown: multiprocessing runs it at exit before
        # joining its children (which would wait forever for this one)
        self._reap = multiprocessing.util.Finalize(self, _stop_child, exitpriority=10,
                                                   args=(self._process, self._conn, self._send_lock, self._wait_lock))
        self._open_lock = threading.Lock()   # _routes/_replies against the reader failing them all
        self._routes: dict[int, tuple[RemoteRequest, Callable[[Any], None]]] = {}
        self._replies: dict[int, queue.SimpleQueue] = {}
        self._keys = itertools.count()
        self._fatal: EngineFatalError | None = None
        self._stopped = False
        self._mailboxes = LoopMailboxes()
        try:
            info = self._wait_ready()
        except BaseException:
            _stop_child(self._process, self._conn, self._send_lock, self._wait_lock, graceful=False)   # no commands yet
            raise
        self.args, self.tokenizer, self.model_path = info.args, info.tokenizer, info.model_path
        self.limits, self._server_info, self._load = info.limits, info.server_info, info.load
        self._reader = threading.Thread(target=self._read, name="specserve-engine-reader", daemon=True)
        self._reader.start()

    # --- what the server uses (Engine has the same) ---
    def abort_request(self, rid: str) -> None:
        self._send(("abort", rid))

    def flush_cache(self) -> int:
        """Drops every cached prefix no running request holds; returns the KV slots freed."""
        token, reply = next(self._keys), queue.SimpleQueue()
        with self._open_lock:
            self._check_open()
            self._replies[token] = reply
        self._send(("flush", token))
        result = reply.get(timeout=STOP_TIMEOUT_S)
        if isinstance(result, Exception):
            raise result
        return result

    def load(self) -> dict:
        """The engine's load as of its last step (it reports it with every step that changes it)."""
        return dict(self._load)

    def get_server_info(self) -> dict:
        return dict(self._server_info)

    @property
    def fatal_error(self) -> EngineFatalError | None:
        """Why the engine stopped: its process died, or its step loop cannot go on."""
        return self._fatal

    @property
    def pid(self) -> int:
        return self._process.pid

    def shutdown(self) -> None:
        with self._open_lock:
            if self._stopped:
                return
            self._stopped = True
        self._reap()
        self._reader.join(timeout=10)   # it fails what is still open, then returns
        self._conn.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- requests ---
    def _make_request(self, ids, params_dict, return_logprob, top_logprobs_num, rid) -> RemoteRequest:
        check_request(ids, params_dict, top_logprobs_num, self.limits)   # bad input: a ValueError here, as in-process
        return RemoteRequest(next(self._keys), rid or uuid.uuid4().hex, ids, params_dict, return_logprob,
                             top_logprobs_num)

    def _submit(self, req: RemoteRequest, sink: Callable[[Any], None], stream: bool) -> None:
        with self._open_lock:
            self._check_open()
            self._routes[req.key] = (req, sink)
        self._send(("add", req.key, req.rid, req.input_ids, req.sampling_params, req.return_logprob,
                    req.top_logprobs_num, stream))

    def _check_open(self) -> None:
        if self._fatal is not None:
            raise EngineFatalError(f"the engine stopped: {self._fatal}")
        if self._stopped:
            raise RuntimeError("the engine has been shut down")

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:   # the child is gone: the reader thread fails what is open
            pass

    # --- start-up ---
    def _wait_ready(self) -> EngineInfo:
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise RuntimeError(f"the engine process {exit_reason(self._process.exitcode)} while starting") from None
        if kind == "failed":
            raise payload
        return payload

    # --- the reader thread ---
    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == "step":
                    self._deliver(*message[1:])
                else:   # ("flushed", token, result)
                    reply = self._replies.pop(message[1], None)
                    if reply is not None:
                        reply.put(message[2])
        except (EOFError, OSError):
            pass
        self._fail_open_requests()

    def _deliver(self, items: list[tuple[int, Any]], load: dict | None, fatal: EngineFatalError | None) -> None:
        if load is not None:
            self._load = load
        if fatal is not None:
            self._fatal = fatal
        routes = self._routes
        for key, item in items:
            route = routes.get(key)
            if route is None:
                continue
            req, sink = route
            if item is None or isinstance(item, Exception):
                req.finished = True
                del routes[key]
            sink(DONE if item is None else item)
        self._mailboxes.wake_all()   # one wake-up of each event loop per step

    def _fail_open_requests(self) -> None:
        """The child has gone (shut down, or died): every open request and call ends now."""
        with self._wait_lock:
            self._process.join(timeout=5)
        with self._open_lock:
            if self._stopped:
                reason: Exception = RuntimeError("the engine was shut down")
            else:
                reason = self._fatal = EngineFatalError(f"the engine process (pid {self._process.pid}) "
                                                        f"{exit_reason(self._process.exitcode)}")
                logger.error("%s", reason)
            routes, self._routes = self._routes, {}
            replies, self._replies = self._replies, {}
        for req, sink in routes.values():
            req.finished = True
            sink(type(reason)(f"request {req.rid} failed: {reason}"))
        self._mailboxes.wake_all()
        for reply in replies.values():
            reply.put(type(reason)(str(reason)))


def exit_reason(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _stop_child(process: multiprocessing.process.BaseProcess, conn, send_lock: threading.Lock,
                wait_lock: threading.Lock, graceful: bool = True) -> None:
    """Asks the child to shut its engine down; kills it if it does not within STOP_TIMEOUT_S
    (terminates it at once where not `graceful`)."""
    with wait_lock:
        if process.is_alive() and not graceful:
            process.terminate()
            process.join(timeout=10)
        if process.is_alive():
            try:
                with send_lock:
                    conn.send(("shutdown",))
            except OSError:
                pass
            process.join(timeout=STOP_TIMEOUT_S)
        if process.is_alive():
            logger.warning("the engine process did not stop in %.0f s: killing it", STOP_TIMEOUT_S)
            process.kill()
        process.join(timeout=10)
