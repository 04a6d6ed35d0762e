"""The engine process's side of EngineProcess (engine_process.py has the wire format):
builds the Engine, serves the server's commands from the pipe, and sends each pass of the
step loop's outputs up as one message.

The server's process imports this module (for the process's target and EngineInfo) but
never the Engine: it is imported in the child, so torch stays out of the server's process.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specserve.args import ServerArgs
from specserve.engine.front import DONE, RequestLimits
from specserve.gc_pauses import freeze_long_lived_objects

if TYPE_CHECKING:
    from specserve.engine.engine import Engine

logger = logging.getLogger("specserve")


@dataclass(frozen=True)
class EngineInfo:
    """What the child tells the server once the engine is built."""
    args: ServerArgs
    tokenizer: Any
    model_path: str
    limits: RequestLimits
    server_info: dict
    load: dict


def serve_engine(args: ServerArgs, conn) -> None:
    """The child's main: returns (and the process exits) at "shutdown" or when the server's
    process is gone (its end of the pipe closed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group: the server decides
    from specserve.engine.engine import Engine
    try:
        engine = Engine(**dataclasses.asdict(args))
        if not args.skip_server_warmup:
            warm_up_request(engine)
    except BaseException as error:
        error.add_note(f"in the engine process:\n{traceback.format_exc()}")
        conn.send(("failed", portable_error(error)))
        return
    try:
        outbox = Outbox(engine, conn)
        server_info = {**engine.get_server_info(), "gc_frozen_objects": freeze_long_lived_objects()}
        conn.send(("ready", EngineInfo(engine.args, engine.tokenizer, engine.model_path, engine.limits,
                                       server_info, outbox.load)))
        engine.add_flush_hook(outbox.flush)
        _serve_commands(engine, conn, outbox)
    finally:
        engine.shutdown()


def warm_up_request(engine: Engine) -> None:
    """One short request before the server opens, so the first client's is not the first."""
    start = time.perf_counter()
    engine.generate(input_ids=engine.tokenizer("The").input_ids or [0],
                    sampling_params={"max_new_tokens": 2, "temperature": 0.0})
    logger.info("warmup request done in %.2f s", time.perf_counter() - start)


class Outbox:
    """Collects the items the engine's sinks produce during a pass of the step loop and
    sends them, with the engine's load, as one message when the pass ends."""

    def __init__(self, engine: Engine, conn):
        self.engine, self.conn = engine, conn
        self.send_lock = threading.Lock()   # the step loop's thread and the command thread both send
        self.items: list[tuple[int, Any]] = []   # appended and swapped on the step loop's thread only
        self.load = engine.load()
        self.fatal = None

    def sink(self, key: int):
        return functools.partial(self.post, key)

    def post(self, key: int, item: Any) -> None:
        if item is DONE:
            item = None
        elif isinstance(item, BaseException):
            item = portable_error(item)
        self.items.append((key, item))

    def flush(self) -> None:
        """The step loop's flush hook: sends nothing when nothing changed (an idle pass)."""
        load, fatal = self.engine.load(), self.engine.fatal_error
        if not self.items and load == self.load and fatal is self.fatal:
            return
        items, self.items = self.items, []
        self.load, self.fatal = load, fatal
        self.send(("step", items, load, fatal))

    def send(self, message: tuple) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except OSError:   # the server's process is gone; the command loop sees it and stops the engine
            pass


def _serve_commands(engine: Engine, conn, outbox: Outbox) -> None:
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            logger.warning("the server's process is gone: stopping the engine")
            return
        kind = message[0]
        if kind == "add":
            _, key, rid, input_ids, params, return_logprob, top_logprobs_num, stream = message
            try:
                engine.add_request(input_ids, params, outbox.sink(key), stream, return_logprob, top_logprobs_num, rid)
            except Exception as error:   # refused before it reached the step loop: its only item
                outbox.send(("step", [(key, portable_error(error))], None, None))
        elif kind == "abort":
            engine.abort_request(message[1])
        elif kind == "flush":
            # waits for the step loop: on its own thread, so that adds and aborts are not held up
            threading.Thread(target=_flush_cache, args=(engine, outbox, message[1]), daemon=True).start()
        elif kind == "shutdown":
            return
        else:
            raise ValueError(f"unknown command {kind!r} from the server")


def _flush_cache(engine: Engine, outbox: Outbox, token: int) -> None:
    try:
        result: Any = engine.flush_cache()
    except Exception as error:
        result = portable_error(error)
    outbox.send(("flushed", token, result))


def portable_error(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
