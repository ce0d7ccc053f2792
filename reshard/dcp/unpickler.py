"""Read a torch.distributed.checkpoint ``.metadata`` file without running any code from it.

DCP writes its metadata with ``pickle.dump``: loading it with ``pickle.load`` lets the file
call any importable function (the ``__reduce__`` trick). This module unpickles it with a
``pickle.Unpickler`` whose ``find_class`` admits an explicit allowlist, and even those
globals never resolve to the real objects:

- DCP's metadata classes (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``,
  ``filesystem._StorageInfo``) become inert ``Record`` stand-ins that only keep the state
  pickle hands them. The real classes are never touched, so a pickle cannot construct them
  with odd arguments or ``BUILD`` attributes onto them (on a class itself, ``BUILD`` fails).
- ``torch.Size``, ``_MEM_FORMAT_ENCODING``, ``torch.serialization._get_layout`` and the
  ``pathlib`` path classes become small checked functions returning tuples, ints and markers
  (a path becomes an inert marker: the import never reads DCP's ``storage_meta``);
  ``torch.<dtype>`` / ``torch.<layout>`` / ``torch.<memory_format>`` constants become
  ``Constant`` markers, looked up in a table built from torch's namespace by type, never by
  ``getattr`` on a name from the file; ``collections.OrderedDict`` becomes ``dict`` (called
  without arguments, as an OrderedDict pickles).
- Every other global, including dotted names that would walk attributes, is refused with
  ``UnsafePickleError`` naming the file and the global, before anything of it runs.

The unpickler, the stand-in types, the record count and the memo scan are shared with the
DeepSpeed importer (``reshard.unpickle``); this module holds DCP's allowlist.

The stand-ins are then checked field by field (``reshard.dcp.metadata``).

What one file may expand to is bounded by its size. Pickle's memo lets a few bytes name an
object again (``BINGET``), so a 66 KB file can list one tensor record, holding one chunk
10,000 times, under 4,700 keys: the unpickle is cheap, the walk over it is not (47 million
chunk records). So every record the import builds or visits counts: each argument a
reconstructor (``torch.Size``, a path class) receives, each ``state_dict_metadata`` entry,
tensor chunk, ``storage_data`` entry and transform descriptor; once the count passes
``record_cap(len(file))`` = ``RECORD_ALLOWANCE`` + one per ``BYTES_PER_RECORD`` bytes, the
file is refused (``DcpImportError`` naming it and the cap) before more is built. The
constant: honest files spend far more per record. ``dcp.save`` of an MLP with Adam on 1, 2,
4 and 8 gloo ranks spent 35.7, 34.3, 32.1 and 30.3 bytes per counted record; single-process
saves of 2,000 0-d tensors 24.8, of 2,000 ints 47.0 (a 0-d chunk record alone is 28 bytes, a
``torch.Size`` call at least 5), so 4 leaves a margin of 6. Each counted record costs O(1)
work, O(64) with its dims, and none is copied per visit: a torch.Size is the tuple unpickled,
a record's state is read by field name, never scanned. Before unpickling, the opcodes are
scanned once: a ``PUT``/``LONG_BINPUT`` memo index past its own offset in the file is
refused (CPython sizes its memo array by the largest index: 9 bytes could claim 64 GiB).

Trade-off: the allowlist follows what torch 2.4 to 2.14 write with the default pickle
protocol; metadata written by a much older torch, a custom planner or storage writer with
its own classes is refused, not guessed at.
"""

from __future__ import annotations

import pickle
import reprlib
from collections.abc import Mapping
from typing import Any

from reshard.errors import DcpImportError
from reshard.unpickle import (
    BYTES_PER_RECORD,
    MAX_NDIM,
    RECORD_ALLOWANCE,
    TORCH_CONSTANTS,
    TORCH_DTYPES,
    Call,
    Constant,
    Record,
    RecordCount,
    ordered_dict,
    record_cap,
    record_type,
    size,
)
from reshard.unpickle import restricted_loads as _restricted_loads


class _Unread:
    """What a pathlib path unpickles to: DCP keeps one in ``storage_meta``, which the import never reads."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "a pathlib path (not read)"


def _mem_format_encoding(value) -> int:
    if type(value) is not int or value not in (0, 1, 2):
        raise pickle.UnpicklingError(f"_MEM_FORMAT_ENCODING({value!r})")
    return value


_LAYOUTS = {f"torch.{name}": const for name, const in TORCH_CONSTANTS.items() if const.kind == "layout"}
_UNREAD = _Unread()


def _get_layout(name) -> Constant:
    const = _LAYOUTS.get(name) if type(name) is str else None
    if const is None:
        raise pickle.UnpicklingError(f"_get_layout({reprlib.repr(name)})")
    return const


def _path(*parts) -> _Unread:
    if not all(type(p) is str for p in parts):
        raise pickle.UnpicklingError(f"path of {reprlib.repr(parts)}")
    return _UNREAD


_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_RECORDS = {
    (_META, name): record_type(name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta")
}
_RECORDS[(_FS, "_StorageInfo")] = record_type("_StorageInfo")
ALLOWED_GLOBALS: Mapping[tuple[str, str], Any] = {
    **_RECORDS,
    ("torch", "Size"): Call("torch.Size", size),
    (_META, "_MEM_FORMAT_ENCODING"): Call("_MEM_FORMAT_ENCODING", _mem_format_encoding),
    ("torch.serialization", "_get_layout"): Call("_get_layout", _get_layout),
    ("collections", "OrderedDict"): Call("OrderedDict", ordered_dict),
    **{("pathlib", cls): Call(f"pathlib.{cls}", _path)
       for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}
_REFUSAL = "DCP metadata may only name DCP's metadata classes, torch.Size and torch dtypes/layouts"


def metadata_records(nbytes: int, where: str) -> RecordCount:
    """A fresh record count for one ``.metadata`` of ``nbytes`` bytes."""
    return RecordCount(nbytes, where, error=DcpImportError)


def restricted_loads(data: bytes, *, where: str, records: RecordCount | None = None) -> Any:
    """Unpickle ``data`` admitting only ``ALLOWED_GLOBALS``; raise UnsafePickleError otherwise.

    ``records`` counts what the reconstructors build (a fresh count for ``data`` when None).
    """
    return _restricted_loads(data, where=where, error=DcpImportError, what="DCP metadata", records=records,
                             allowed=ALLOWED_GLOBALS, refusal=_REFUSAL, torch_constants=True)


__all__ = ["ALLOWED_GLOBALS", "BYTES_PER_RECORD", "MAX_NDIM", "RECORD_ALLOWANCE", "TORCH_DTYPES", "Constant",
           "Record", "RecordCount", "metadata_records", "record_cap", "restricted_loads"]
