"""The tools' arguments: dtypes and meshes (sizes: ``reshard.sizes``), parsed once for the API and the CLI.

A malformed one is a ValueError (``BudgetError`` for a size): the command line's exit 2.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from reshard._shardfmt import Mesh, TopologyError, dtype_code, torch_dtype
from reshard.sizes import human, parse_size

FLOATING = frozenset({"F16", "BF16", "F32", "F64"})  # what --dtype casts (float8 kinds stay as they are)
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16,
          "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "f32": torch.float32,
          "float32": torch.float32, "float": torch.float32, "fp64": torch.float64, "f64": torch.float64,
          "float64": torch.float64, "double": torch.float64}

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
