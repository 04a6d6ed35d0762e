"""`python -m specserve.launch_server --model-path M --port 30000 [ServerArgs flags]`.

The command line, the port and the model's cheap checks are verified before the model loads
(seconds to minutes): a mistake is one line on stderr, at once."""
from __future__ import annotations

from collections.abc import Sequence

from specserve.args import ServerArgs
from specserve.cli import ArgumentParser, run_cli, setup_logging
from specserve.net import check_port_free


def main(argv: Sequence[str] | None = None) -> None:
    from specserve.server.launch import main as serve
    parser = ArgumentParser(prog="python -m specserve.launch_server",
                            description="Serve a model over HTTP (OpenAI and SGLang APIs).")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    setup_logging(ns.log_level)
    check_port_free(ns.host, ns.port)
    serve(argv)


if __name__ == "__main__":
    run_cli(main)
