"""`python -m specserve.launch_server`: start the engine in its own process (built and warmed
up there), and serve `create_app(engine)` with uvicorn in this one until interrupted or until
the engine stops (lifecycle.py: how the server ends).

The split keeps the HTTP event loop off the step loop's GIL (engine_process.py says why)."""
from __future__ import annotations

import argparse
import contextlib
import signal
from typing import Iterator

from specserve.args import ServerArgs


def launch_server(args: ServerArgs) -> None:
    import uvicorn

    from specserve.engine.engine_process import EngineProcess
    from specserve.gc_pauses import freeze_long_lived_objects
    from specserve.server.http import create_app
    from specserve.server.lifecycle import ENGINE_STOPPED_EXIT_CODE, ServingServer, stuck_connection_timeout

    with _sigterm_raises_system_exit():
        engine = EngineProcess(args)   # a start-up failure (bad model path, ...) is raised here, before uvicorn
        try:
            app = create_app(engine)
            freeze_long_lived_objects()   # this process streams every token: no full-heap walks mid-request
            timeout = args.graceful_shutdown_timeout
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                    # one line per request (method, path, status) at info and debug, as uvicorn's default
                                    access_log=args.log_level in ("debug", "info"), timeout_keep_alive=30,
                                    timeout_graceful_shutdown=stuck_connection_timeout(timeout))
            server = ServingServer(config, app.state.server, timeout)
            server.run()
        finally:
            engine.shutdown()
        if server.engine_stopped_at is not None:
            raise SystemExit(ENGINE_STOPPED_EXIT_CODE)
        if server.interrupted:
            # uvicorn raises a captured Ctrl-C again once it has shut down, but asyncio's runner, whose
            # SIGINT handler uvicorn restores, may take it as a cancel of a task that has already ended:
            # then run() returns and the process would exit 0
            raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_raises_system_exit() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGTERM, then raises it again under the handler it
    found: an exception (where the default handler would kill) lets the engine process be stopped."""
    def exit_on_signal(signum: int, frame) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.launch_server",
                                     description="Serve a model over HTTP (OpenAI and SGLang APIs).")
    ServerArgs.add_cli_args(parser)
    launch_server(ServerArgs.from_cli_args(parser.parse_args(argv)))
