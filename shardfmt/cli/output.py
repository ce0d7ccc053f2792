"""What both command-line tools print and how they end: one-line errors, JSON, sizes, a closed
stdout. Imports nothing heavy: ``--help`` and ``--version`` never import torch."""

from __future__ import annotations

import importlib
import os
import sys

import orjson

from shardfmt.errors import CheckpointNotFoundError, FormatVersionError, ShardfmtError, StorageError

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: the status a shell shows for a command its reader stopped (`... | head`)


def print_json(obj) -> None:
    option = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS
    try:
        text = orjson.dumps(obj, option=option)
    except TypeError:  # a string JSON cannot hold: a file name that is not UTF-8
        text = orjson.dumps(_utf8(obj), option=option)
    sys.stdout.write(text.decode() + "\n")


def _utf8(obj):
    """``obj`` with every string valid UTF-8: the bytes of a name that is not (which Python
    keeps as lone surrogates) appear as ``\\xNN``."""
    if isinstance(obj, str):
        try:
            return obj.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate no undecodable byte stands for
            return obj.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(obj, dict):
        return {_utf8(k): _utf8(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_utf8(v) for v in obj]
    return obj


def stdout_closed() -> int:
    """The reader of stdout went away (``shardfmt ls ROOT | head``): send what is left to
    /dev/null, so that neither this nor the flush at exit prints a traceback, and return
    ``SIGPIPE_EXIT``. Both command-line tools end this way."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (captured): nothing to flush at exit
        pass
    return SIGPIPE_EXIT


def human(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: a byte count for messages (both tools)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def byte_bar(desc: str, *, shown: bool = True):
    """A progress bar of bytes for a long command (None when not ``shown``); tqdm hides it when
    stderr is not a terminal. Give its ``update`` as the work's progress callback."""
    if not shown:
        return None
    from tqdm import tqdm  # here: only a command that shows a bar pays for its import

    return tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, dynamic_ncols=True,
                leave=False)


def deferred(module: str, name: str, *bound):
    """A command that imports ``module`` when it runs and calls its ``name(*bound, args)``: the
    parser names commands that need torch without importing it."""
    def command(args) -> int:
        return getattr(importlib.import_module(module), name)(*bound, args)
    return command


def run(prog: str, command, args, *, interrupted: str = "") -> int:
    """Run ``command(args)`` and end as both tools do: its status; 2 for a path that is
    unreachable or names no checkpoint, a newer format version (never judged invalid) or a bad
    argument (a ``ValueError``); 1 for any other shardfmt error; 130 on Ctrl-C (``prog:
    interrupted`` and ``interrupted``); 141 when stdout's reader went away. One line, never a
    traceback."""
    try:
        rc = command(args)
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return rc
    except BrokenPipeError:
        return stdout_closed()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted{interrupted}", file=sys.stderr)
        return 130
    except (CheckpointNotFoundError, StorageError, FormatVersionError, ValueError) as e:
        return failed(prog, e, 2)
    except ShardfmtError as e:
        return failed(prog, e, 1)


def failed(prog: str, error: BaseException, status: int) -> int:
    """Print ``error`` as one line in the command line's words (its kind, never a Python class
    name: ``reshard: error: memory budget: ...``) and return ``status``."""
    kind = getattr(error, "kind", None)
    print(f"{prog}: error: {kind + ': ' if kind else ''}{error}", file=sys.stderr)
    return status


def usage(prog: str, msg: str) -> int:
    """Print ``prog: error: msg`` (a usage error) and return its exit status, 2."""
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2
