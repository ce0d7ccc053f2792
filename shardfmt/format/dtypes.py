"""The dtypes shardfmt stores, as safetensors names them, and their sizes.

One table maps torch dtypes to the safetensors dtype strings that appear in both the
safetensors headers and the manifest. A dtype not in the table cannot be stored.
"""

from __future__ import annotations

import torch

from shardfmt.errors import DTypeError

_TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
    ("complex64", "C64"),
):
    if hasattr(torch, _name):
        _TORCH_TO_ST[getattr(torch, _name)] = _code

_ST_TO_TORCH: dict[str, torch.dtype] = {v: k for k, v in _TORCH_TO_ST.items()}

SUPPORTED_DTYPES: tuple[str, ...] = tuple(sorted(_ST_TO_TORCH))


def dtype_code(dtype: torch.dtype, *, what: str = "tensor") -> str:
    """Return the safetensors dtype string for ``dtype``; raise naming ``what`` if none."""
    try:
        return _TORCH_TO_ST[dtype]
    except KeyError:
        raise DTypeError(
            f"{what}: dtype {dtype} cannot be stored in safetensors "
            f"(supported: {', '.join(SUPPORTED_DTYPES)})"
        ) from None


def torch_dtype(code: str, *, what: str = "tensor") -> torch.dtype:
    """Return the torch dtype for a safetensors dtype string."""
    try:
        return _ST_TO_TORCH[code]
    except KeyError:
        raise DTypeError(f"{what}: unknown dtype {code!r}") from None


def itemsize(code: str) -> int:
    """Return the size in bytes of one element of dtype ``code``."""
    return torch_dtype(code).itemsize
