"""The tools' arguments: sizes, dtypes and meshes, parsed once for the API and the CLI.

A malformed one is a ValueError (``BudgetError`` for a size): the command line's exit 2.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from reshard._shardfmt import Mesh, TopologyError, dtype_code, torch_dtype
from reshard.errors import BudgetError

FLOATING = frozenset({"F16", "BF16", "F32", "F64"})  # what --dtype casts (float8 kinds stay as they are)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "f32": torch.float32,
          "float32": torch.float32, "float": torch.float32, "fp64": torch.float64, "f64": torch.float64,
          "float64": torch.float64, "double": torch.float64}

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


def human(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``: a byte count for messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"`` / ``torch.bfloat16`` -> torch.bfloat16; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype_code(dtype) not in FLOATING:
            raise ValueError(f"--dtype {dtype}: only floating dtypes ({', '.join(sorted(DTYPES))})")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"--dtype {dtype!r}: expected one of {', '.join(sorted(DTYPES))}") from None


def out_dtype(code: str, cast: torch.dtype | None) -> torch.dtype:
    """The dtype a record of ``code`` is written in: ``cast`` for floating records, else its own."""
    return cast if cast is not None and code in FLOATING else torch_dtype(code)


def parse_mesh(mesh: str | Mapping[str, int] | Mesh) -> Mesh:
    """A ``Mesh`` from ``"pp=2,tp=4"``, a mapping or a Mesh; a bad one is a ValueError (the
    command-line tools' exit 2: a bad argument)."""
    if isinstance(mesh, Mesh):
        return mesh
    try:
        return Mesh.parse(mesh)
    except TopologyError as e:
        raise ValueError(f"mesh: {e}") from None


__all__ = ["DTYPES", "FLOATING", "human", "out_dtype", "parse_dtype", "parse_mesh", "parse_size"]
