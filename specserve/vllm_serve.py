"""`python -m specserve.vllm_serve MODEL [vLLM flags]`: a `vllm serve` command line served by
specserve (vllm_compat.py says what each flag becomes), on vLLM's port 8000 by default.

As with launch_server, the flags and the port are checked before the model loads: a mistake
is one line on stderr, at once."""
from __future__ import annotations

from collections.abc import Sequence

from specserve.cli import run_cli, setup_logging
from specserve.net import check_port_free


def main(argv: Sequence[str] | None = None) -> None:
    from specserve.server.launch import launch_server
    from specserve.vllm_compat import server_args
    setup_logging()   # the flags' warnings in the usual format; the level is set once they are read
    args = server_args(argv)
    setup_logging(args.log_level)
    check_port_free(args.host, args.port)
    launch_server(args)


if __name__ == "__main__":
    run_cli(main)
