"""The errors a user can cause, one type per kind, and the did-you-mean hint they share.

Each type subclasses `UserError` (the command-line entry points print its message as one
line on stderr and exit non-zero, with no traceback) and the builtin exception a Python
caller would expect for that kind (`except ValueError` keeps working). The Python API
raises the same types with the same messages the command line prints.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Caused by what the user asked for or by their machine, not by a bug in specserve."""


class ArgumentError(UserError, ValueError):
    """A setting has a value it cannot take; the message names the setting."""


class UnknownArgumentError(UserError, TypeError):
    """A keyword or flag that no setting has (TypeError: what Python raises for an unknown keyword)."""


class NotSupportedError(UserError, NotImplementedError):
    """A feature specserve does not have (yet): an SGLang option, an algorithm, parallelism."""


class ModelNotFoundError(UserError, FileNotFoundError):
    """The model path is neither a local file or directory nor a reachable hub id."""


class ModelFormatError(UserError, ValueError):
    """The model is there but cannot be read: a corrupt GGUF, no tokenizer, an unsupported architecture."""


class DeviceError(UserError, ValueError):
    """The requested device is not usable on this machine."""


class PortInUseError(UserError, OSError):
    """The server's port is taken by another process."""


class ServerUnreachableError(UserError, ConnectionError):
    """A benchmark's server does not answer."""


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """' (did you mean X?)' for the closest candidate, or '' when none is close.

    `prefix` is put before the suggestion, e.g. '--' for a flag."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def one_line(error: BaseException) -> str:
    """The error's message with its whitespace (newlines of a compiler's output, ...) collapsed."""
    return " ".join(str(error).split()) or type(error).__name__


class EngineFatalError(RuntimeError):
    """The engine cannot take another step (a tensor-parallel rank died, say): every request
    fails with it and the engine refuses new ones, instead of failing them one by one."""
