"""What every `python -m specserve.*` command shares: its argument parser and its way out.

A user error (a `UserError`, a misspelled flag, a bad value) ends the command with one line
on stderr and exit status 1 (2 for a bad command line, as argparse does); the traceback
only with `--log-level debug`. Log lines go to stderr through tqdm, so they never break a
progress bar, and stdout carries only what the command is for (the generated text, a
benchmark's table).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, TypeVar

from specserve.errors import ArgumentError, UserError, did_you_mean, one_line

T = TypeVar("T")
USAGE_ERROR = 2   # argparse's status for a bad command line
USER_ERROR = 1


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with a one-line error (not the usage of 100 flags) and a suggestion for a
    misspelled flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a prefix of a flag is a typo here, not a choice
        kwargs.setdefault("usage", "%(prog)s [options]  (--help lists them)")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {self._with_suggestions(message)} (see --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR)

    def _with_suggestions(self, message: str) -> str:
        match = re.match(r"unrecognized arguments: (.*)", message)
        if not match:
            return message
        known = [flag[2:] for action in self._actions for flag in action.option_strings
                 if flag.startswith("--") and action.help != argparse.SUPPRESS]
        unknown = [arg for arg in match.group(1).split() if arg.startswith("--")]
        hints = [f"{arg.split('=')[0]}{did_you_mean(arg[2:].split('=')[0], known, '--')}" for arg in unknown]
        return f"unrecognized arguments: {' '.join(hints) or match.group(1)}"


def run_cli(main: Callable[[Sequence[str] | None], T], argv: Sequence[str] | None = None) -> T:
    """Runs an entry point's `main(argv)`, turning a user error into one line and an exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(args)
    try:
        return main(args)
    except UserError as error:
        if debug:
            raise
        print(f"specserve: error: {one_line(error)}", file=sys.stderr)
        sys.exit(USER_ERROR)
    except KeyboardInterrupt:
        print("specserve: interrupted", file=sys.stderr)
        sys.exit(130)


def _debug_requested(args: list[str]) -> bool:
    for i, arg in enumerate(args):
        if arg == "--log-level=debug" or (arg == "--log-level" and args[i + 1:i + 2] == ["debug"]):
            return True
    return False


class _TqdmHandler(logging.StreamHandler):
    """Writes through tqdm, which clears a progress bar, prints the line, and redraws the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def setup_logging(level: str = "info") -> None:
    """Log lines of the whole process on stderr, safe beside tqdm bars. Called by the entry
    points before the Engine; the Engine's own logging.basicConfig then changes nothing."""
    root = logging.getLogger()
    if not any(isinstance(h, _TqdmHandler) for h in root.handlers):
        handler = _TqdmHandler()
        handler.setFormatter(logging.Formatter("[specserve %(asctime)s] %(message)s", datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level.upper())
    # third-party chatter (HTTP requests of huggingface_hub, ...) only when debugging
    for noisy in ("httpx", "httpcore", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


@contextlib.contextmanager
def stage(what: str) -> Iterator[None]:
    """A log line before a slow stage and one with its time after."""
    logger = logging.getLogger("specserve")
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: done in %.1f s", what, time.perf_counter() - start)


def check_file(flag: str, path: str | None) -> None:
    """An ArgumentError naming `flag` when `path` is given but is not a readable file."""
    if path is not None and not os.path.isfile(os.path.expanduser(path)):
        raise ArgumentError(f"{flag}: {path} is not a file")
