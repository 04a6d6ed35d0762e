"""`python -m specserve.launch_server`: build the Engine from ServerArgs flags, warm it
up, and serve `create_app(engine)` with uvicorn until interrupted."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from specserve.args import ServerArgs

logger = logging.getLogger("specserve")


def launch_server(args: ServerArgs) -> None:
    import uvicorn

    from specserve.engine.engine import Engine
    from specserve.server.http import create_app

    engine = Engine(**dataclasses.asdict(args))
    try:
        if not args.skip_server_warmup:
            start = time.perf_counter()
            engine.generate(input_ids=engine.tokenizer("The").input_ids or [0],
                            sampling_params={"max_new_tokens": 2, "temperature": 0.0})
            logger.info("warmup request done in %.2f s", time.perf_counter() - start)
        app = create_app(engine)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                # one line per request (method, path, status) at info and debug, as uvicorn's default
                                access_log=args.log_level in ("debug", "info"), timeout_keep_alive=30)
        uvicorn.Server(config).run()
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.launch_server",
                                     description="Serve a model over HTTP (OpenAI and SGLang APIs).")
    ServerArgs.add_cli_args(parser)
    launch_server(ServerArgs.from_cli_args(parser.parse_args(argv)))
