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

import io
import pickle
import pickletools
import reprlib
from collections.abc import Mapping
from typing import Any

import torch

from reshard.errors import DcpImportError, UnsafePickleError

MAX_NDIM = 64  # dims of a torch.Size
BYTES_PER_RECORD = 4  # an honest .metadata spends at least this much per record (module docstring)
RECORD_ALLOWANCE = 4096  # records any .metadata may build on top of that


def record_cap(nbytes: int) -> int:
    """The most records a ``.metadata`` of ``nbytes`` bytes may build or visit."""
    return RECORD_ALLOWANCE + nbytes // BYTES_PER_RECORD


class RecordCount:
    """Counts the records built and visited for one ``.metadata``; refuses it past its cap."""

    __slots__ = ("where", "nbytes", "cap", "count")

    def __init__(self, nbytes: int, where: str) -> None:
        self.where = where
        self.nbytes = nbytes
        self.cap = record_cap(nbytes)
        self.count = 0

    def add(self, n: int, what: str) -> None:
        self.count += n
        if self.count > self.cap:
            raise DcpImportError(
                f"{self.where}: expands past {self.cap} records ({what}): a .metadata of {self.nbytes} bytes may "
                f"build at most {RECORD_ALLOWANCE} + 1 per {BYTES_PER_RECORD} bytes (this one refers to the same "
                "pickled objects over and over); refused before building more")


# ----------------------------------------------------------------------------- stand-ins


class Record:
    """An inert stand-in for one DCP metadata class: records the pickled state, runs nothing."""

    __slots__ = ("state",)
    kind = ""

    def __new__(cls, *args, **kwargs):
        if args or kwargs:  # NEWOBJ/REDUCE with arguments: DCP's dataclasses pickle without any
            raise pickle.UnpicklingError(f"DCP {cls.kind} built with arguments {reprlib.repr(args)}")
        self = object.__new__(cls)
        self.state = None
        return self

    def __setstate__(self, state) -> None:  # BUILD; on the class itself this call fails (no self)
        if self.state is not None:
            raise pickle.UnpicklingError(f"DCP {self.kind} state set twice")
        self.state = state


def _record_type(kind: str) -> type[Record]:
    return type(f"_{kind}Record", (Record,), {"__slots__": (), "kind": kind})


class Constant:
    """A torch dtype, layout or memory format named by the pickle (``kind``, e.g. ``dtype``)."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind = kind
        self.name = name

    def __setstate__(self, state) -> None:
        raise pickle.UnpicklingError(f"cannot BUILD on torch.{self.name}")

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Unread:
    """What a pathlib path unpickles to: DCP keeps one in ``storage_meta``, which the import never reads."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "a pathlib path (not read)"


class _Call:
    """A checked reconstructor the pickle may call (REDUCE); refuses BUILD.

    Bound to one file's ``RecordCount`` (``bind``), it counts each call as one record per
    argument (at least one) before running: a memoised argument tuple can be passed again
    for a few bytes.
    """

    __slots__ = ("label", "fn", "records")

    def __init__(self, label: str, fn, records: RecordCount | None = None) -> None:
        self.label = label
        self.fn = fn
        self.records = records

    def bind(self, records: RecordCount) -> _Call:
        return _Call(self.label, self.fn, records)

    def __call__(self, *args):
        if self.records is None:
            raise pickle.UnpicklingError(f"{self.label} called outside an unpickler")
        self.records.add(max(1, len(args)), self.label)
        return self.fn(*args)

    def __setstate__(self, state) -> None:
        raise pickle.UnpicklingError(f"cannot BUILD on {self.label}")


def _size(dims=()) -> tuple[int, ...]:
    # torch.Size pickles as (torch.Size, (tuple(self),)): the tuple is kept, never copied
    if type(dims) is not tuple or len(dims) > MAX_NDIM or not all(type(d) is int for d in dims):
        raise pickle.UnpicklingError(f"torch.Size of {reprlib.repr(dims)} (expected a tuple of at most "
                                     f"{MAX_NDIM} integers)")
    return dims


def _mem_format_encoding(value) -> int:
    if type(value) is not int or value not in (0, 1, 2):
        raise pickle.UnpicklingError(f"_MEM_FORMAT_ENCODING({value!r})")
    return value


_TORCH_CONSTANTS: dict[str, Constant] = {}
TORCH_DTYPES: dict[str, torch.dtype] = {}
for _name, _obj in sorted(vars(torch).items()):
    if isinstance(_obj, torch.dtype):
        _TORCH_CONSTANTS[_name] = Constant("dtype", _name)
        TORCH_DTYPES[_name] = _obj
    elif isinstance(_obj, torch.layout):
        _TORCH_CONSTANTS[_name] = Constant("layout", _name)
    elif isinstance(_obj, torch.memory_format):
        _TORCH_CONSTANTS[_name] = Constant("memory_format", _name)


_LAYOUTS = {f"torch.{name}": const for name, const in _TORCH_CONSTANTS.items() if const.kind == "layout"}
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


def _ordered_dict(*args) -> dict:
    if args:  # copying a memoised list of items on every call would cost its length each time
        raise pickle.UnpicklingError(f"OrderedDict called with arguments {reprlib.repr(args)} (it pickles "
                                     "as OrderedDict() followed by SETITEMS)")
    return {}


_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_RECORDS = {
    (_META, name): _record_type(name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta")
}
_RECORDS[(_FS, "_StorageInfo")] = _record_type("_StorageInfo")
ALLOWED_GLOBALS: Mapping[tuple[str, str], Any] = {
    **_RECORDS,
    ("torch", "Size"): _Call("torch.Size", _size),
    (_META, "_MEM_FORMAT_ENCODING"): _Call("_MEM_FORMAT_ENCODING", _mem_format_encoding),
    ("torch.serialization", "_get_layout"): _Call("_get_layout", _get_layout),
    ("collections", "OrderedDict"): _Call("OrderedDict", _ordered_dict),
    **{("pathlib", cls): _Call(f"pathlib.{cls}", _path)
       for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str, records: RecordCount) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._records = records

    def find_class(self, module: str, name: str):
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is None and module == "torch":
            obj = _TORCH_CONSTANTS.get(name)
        if obj is None:
            raise UnsafePickleError(
                f"{self._where}: refused global {module}.{name}: DCP metadata may only name DCP's "
                "metadata classes, torch.Size and torch dtypes/layouts; this pickle would import "
                "something else (possibly to run code), nothing of it was executed")
        return obj.bind(self._records) if isinstance(obj, _Call) else obj

    def persistent_load(self, pid):
        raise UnsafePickleError(f"{self._where}: refused persistent id {pid!r} (DCP metadata has none)")


def _opcode_table() -> tuple[list[int], dict[int, int], dict[int, int]]:
    """From pickletools: each opcode's length if fixed (else 0), its length-prefix size, its text lines."""
    fixed, prefixed, lines = [0] * 256, {}, {}
    prefix = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
              pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        n = 0 if op.arg is None else op.arg.n
        if n >= 0:
            fixed[code] = 1 + n
        elif n == pickletools.UP_TO_NEWLINE:
            lines[code] = 2 if op.arg.name == "stringnl_noescape_pair" else 1
        else:
            prefixed[code] = prefix[n]
    for special in (b"r", b"."):  # LONG_BINPUT is checked, STOP ends the scan
        fixed[special[0]] = 0
    return fixed, prefixed, lines


_OP_FIXED, _OP_PREFIXED, _OP_LINES = _opcode_table()


def _check_memo_indices(data: bytes, *, where: str) -> None:
    """Refuse a pickle that stores into the memo at an index past its own offset in the file.

    CPython's unpickler keeps its memo in an array it grows to twice the largest index
    ``PUT``/``LONG_BINPUT`` name, so nine bytes could make it allocate 64 GiB; pickle
    protocols 4 and 5 (what DCP writes) number the memo implicitly (``MEMOIZE``). The scan
    reads opcodes as the unpickler does and stops at ``STOP`` or where the unpickler fails.
    """
    fixed, prefixed, lines = _OP_FIXED, _OP_PREFIXED, _OP_LINES
    i, end = 0, len(data)
    while i < end:
        op = data[i]
        step = fixed[op]
        if step:
            i += step
            continue
        index = None
        if op == 0x72:  # LONG_BINPUT
            index = int.from_bytes(data[i + 1:i + 5], "little")
            nxt = i + 5
        elif op in prefixed:
            k = prefixed[op]
            nxt = i + 1 + k + int.from_bytes(data[i + 1:i + 1 + k], "little")
        elif op in lines:
            nxt = data.find(b"\n", i + 1)
            if nxt >= 0 and lines[op] == 2:
                nxt = data.find(b"\n", nxt + 1)
            if nxt < 0:
                return  # the unpickler fails here
            if op == 0x70:  # PUT
                try:
                    index = int(data[i + 1:nxt])
                except ValueError:
                    return  # the unpickler fails here
            nxt += 1
        else:
            return  # STOP, or an opcode the unpickler refuses
        if index is not None and index > i:
            raise DcpImportError(f"{where}: the pickle stores into memo index {index} at byte {i}: an index past "
                                 "its offset makes the unpickler allocate memory for it; refused")
        i = nxt


def restricted_loads(data: bytes, *, where: str, records: RecordCount | None = None) -> Any:
    """Unpickle ``data`` admitting only ``ALLOWED_GLOBALS``; raise UnsafePickleError otherwise.

    ``records`` counts what the reconstructors build (a fresh count for ``data`` when None).
    """
    _check_memo_indices(data, where=where)
    try:
        return _RestrictedUnpickler(data, where, RecordCount(len(data), where) if records is None else records).load()
    except DcpImportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a hostile or broken pickle is one error
        raise DcpImportError(f"{where}: not a readable DCP metadata pickle ({type(e).__name__}: {e})") from None

__all__ = ["ALLOWED_GLOBALS", "BYTES_PER_RECORD", "MAX_NDIM", "RECORD_ALLOWANCE", "TORCH_DTYPES", "Constant",
           "Record", "RecordCount", "record_cap", "restricted_loads"]
