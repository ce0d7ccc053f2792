"""Byte sizes, parsed and shown once for the tools' functions and their command line (torch-free:
the parser takes sizes as it reads the arguments). A malformed size is a ``BudgetError`` (a
``ValueError``: the command line's exit 2)."""

from __future__ import annotations

import re

from reshard.errors import BudgetError
from shardfmt.cli.output import human  # one formatter for both tools

_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: int | str, *, what: str = "size") -> int:
    """Return bytes for ``1073741824``, ``"1GiB"``, ``"256MiB"``, ``"5GB"`` (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, bool):
        raise BudgetError(f"{what}: {text!r} is not a size")
    if isinstance(text, int):
        n = text
    else:
        m = _SIZE_RE.fullmatch(str(text))
        if not m:
            raise BudgetError(f"{what}: {text!r} is not a size (e.g. 1073741824, 1GiB, 256MiB, 5GB)")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise BudgetError(f"{what}: {text!r} must be positive")
    return n


__all__ = ["human", "parse_size"]
