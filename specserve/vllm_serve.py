"""`python -m specserve.vllm_serve MODEL [vLLM flags]`: a `vllm serve` command line served by
specserve (vllm_compat.py says what each flag becomes), on vLLM's port 8000 by default.

As with launch_server, the flags and the port are checked before the model loads: a mistake
is one line on stderr, at once."""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from specserve.args import ServerArgs
from specserve.cli import ArgumentParser, run_cli, setup_logging
from specserve.net import check_port_free
from specserve.vllm_compat import MAPPED, SHORT_FLAGS, VLLM_ONLY_OPTIONS, flag, json_object, server_args_of, token_count


def main(argv: Sequence[str] | None = None) -> None:
    from specserve.server.launch import launch_server
    setup_logging()   # the flags' warnings in the usual format; the level is set once they are read
    args = server_args(argv)
    setup_logging(args.log_level)
    check_port_free(args.host, args.port)
    launch_server(args)


def server_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """The ServerArgs of a `vllm serve` command line (without `vllm serve`): a UserError, or
    argparse's exit, for what specserve cannot do."""
    return server_args_of(vars(build_parser().parse_args(argv)))


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m specserve.vllm_serve", usage="%(prog)s [MODEL] [vLLM flags]  "
                            "(--help lists them)", description="Serve a model over HTTP (OpenAI and SGLang APIs), "
                            "started with vLLM's `vllm serve` flags.")
    parser.add_argument("model_tag", nargs="?", default=argparse.SUPPRESS, metavar="MODEL",
                        help="HF id, HF directory or .gguf file; default: SmolLM2-135M-Instruct")
    group = parser.add_argument_group("vLLM flags and the specserve settings they set")
    for name, mapped in MAPPED.items():
        _add_flag(group, name, mapped.kind, mapped.help)
    group = parser.add_argument_group(
        "vLLM flags specserve has no setting for",
        "one that tunes something specserve does its own way is ignored with a warning; one that asks for a "
        "feature specserve lacks is an error unless it is at vLLM's default")
    for name, (default, kind, tuning) in VLLM_ONLY_OPTIONS.items():
        refused = "a feature specserve lacks" + ("" if default is None else f": only {default!r}")
        _add_flag(group, name, kind, f"ignored: {tuning}" if tuning else refused)
    return parser


def _add_flag(group: argparse._ArgumentGroup, name: str, kind: str, help_text: str) -> None:
    kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
    if kind == "b":
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type={"i": int, "f": float, "t": token_count, "j": json_object}.get(kind, str),
                      nargs="+" if kind == "l" else None)
    group.add_argument(flag(name), *SHORT_FLAGS.get(name, ()), **kwargs)


if __name__ == "__main__":
    run_cli(main)
