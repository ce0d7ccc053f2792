"""Unpickle a foreign checkpoint's pickle without running any code from it (shared by the importers).

``pickle.load`` lets a file call any importable function (the ``__reduce__`` trick). The
importers (``reshard.dcp`` for DCP's ``.metadata``, ``reshard.deepspeed`` for DeepSpeed's
``torch.save`` files) unpickle with ``RestrictedUnpickler``: its ``find_class`` admits only the
caller's allowlist, whose entries never resolve to the real objects:

- classes become inert ``Record`` stand-ins (``record_type``) that only keep the state pickle
  hands them; the real classes are never touched;
- reconstructors become ``Call`` wrappers of small checked functions returning plain values;
- ``torch.<dtype>`` / ``torch.<layout>`` / ``torch.<memory_format>`` become ``Constant``
  markers (with ``torch_constants``), looked up in a table built from torch's namespace by
  type, never by ``getattr`` on a name from the file;
- every other global, including dotted names that would walk attributes, is refused with
  ``UnsafePickleError`` naming the file and the global, before anything of it runs.

What one file may expand to is bounded by its size: every record a reconstructor builds
counts towards ``record_cap(len(file))`` (``RecordCount``; the DCP importer documents the
constants), and before unpickling the opcodes are scanned once: a ``PUT``/``LONG_BINPUT`` memo
index past its own offset in the file is refused (CPython sizes its memo array by the
largest index: 9 bytes could claim 64 GiB).
"""

from __future__ import annotations

import io
import pickle
import pickletools
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from reshard.errors import UnsafePickleError
from shardfmt.errors import ShardfmtError

MAX_NDIM = 64  # dims of a torch.Size
BYTES_PER_RECORD = 4  # an honest pickle spends at least this much per record (reshard.dcp.unpickler)
RECORD_ALLOWANCE = 4096  # records any pickle may build on top of that


def record_cap(nbytes: int) -> int:
    """The most records a pickle of ``nbytes`` bytes may build or visit."""
    return RECORD_ALLOWANCE + nbytes // BYTES_PER_RECORD


class RecordCount:
    """Counts the records built and visited for one pickle; refuses it (``error``) past its cap."""

    __slots__ = ("where", "nbytes", "cap", "count", "error")

    def __init__(self, nbytes: int, where: str, *, error: type[ShardfmtError]) -> None:
        self.where = where
        self.nbytes = nbytes
        self.cap = record_cap(nbytes)
        self.count = 0
        self.error = error

    def add(self, n: int, what: str) -> None:
        self.count += n
        if self.count > self.cap:
            raise self.error(
                f"{self.where}: expands past {self.cap} records ({what}): a pickle of {self.nbytes} bytes may "
                f"build at most {RECORD_ALLOWANCE} + 1 per {BYTES_PER_RECORD} bytes (this one refers to the same "
                "pickled objects over and over); refused before building more")


class Record:
    """An inert stand-in for one class a pickle names: records the pickled state, runs nothing."""

    __slots__ = ("state",)
    kind = ""

    def __new__(cls, *args, **kwargs):
        if args or kwargs:  # NEWOBJ/REDUCE with arguments: the admitted classes pickle without any
            raise pickle.UnpicklingError(f"{cls.kind} built with arguments {reprlib.repr(args)}")
        self = object.__new__(cls)
        self.state = None
        return self

    def __setstate__(self, state) -> None:  # BUILD; on the class itself this call fails (no self)
        if self.state is not None:
            raise pickle.UnpicklingError(f"{self.kind} state set twice")
        self.state = state


def record_type(kind: str) -> type[Record]:
    """A fresh ``Record`` subclass standing in for the class ``kind``."""
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


class Call:
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

    def bind(self, records: RecordCount) -> Call:
        return Call(self.label, self.fn, records)

    def __call__(self, *args):
        if self.records is None:
            raise pickle.UnpicklingError(f"{self.label} called outside an unpickler")
        self.records.add(max(1, len(args)), self.label)
        return self.fn(*args)

    def __setstate__(self, state) -> None:
        raise pickle.UnpicklingError(f"cannot BUILD on {self.label}")


def size(dims=()) -> tuple[int, ...]:
    """``torch.Size``: pickles as (torch.Size, (tuple(self),)); the tuple is kept, never copied."""
    if type(dims) is not tuple or len(dims) > MAX_NDIM or not all(type(d) is int for d in dims):
        raise pickle.UnpicklingError(f"torch.Size of {reprlib.repr(dims)} (expected a tuple of at most "
                                     f"{MAX_NDIM} integers)")
    return dims


def ordered_dict(*args) -> dict:
    """``collections.OrderedDict()``: a plain dict (items follow by SETITEMS)."""
    if args:  # copying a memoised list of items on every call would cost its length each time
        raise pickle.UnpicklingError(f"OrderedDict called with arguments {reprlib.repr(args)} (it pickles "
                                     "as OrderedDict() followed by SETITEMS)")
    return {}


TORCH_CONSTANTS: dict[str, Constant] = {}
TORCH_DTYPES: dict[str, torch.dtype] = {}
for _name, _obj in sorted(vars(torch).items()):
    if isinstance(_obj, torch.dtype):
        TORCH_CONSTANTS[_name] = Constant("dtype", _name)
        TORCH_DTYPES[_name] = _obj
    elif isinstance(_obj, torch.layout):
        TORCH_CONSTANTS[_name] = Constant("layout", _name)
    elif isinstance(_obj, torch.memory_format):
        TORCH_CONSTANTS[_name] = Constant("memory_format", _name)


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler admitting only ``allowed`` (plus torch constants with ``torch_constants``).

    ``refusal`` ends the message of a refused global (what the file may name);
    ``persistent_load`` handles persistent ids (refused when None).
    """

    def __init__(self, data: bytes, where: str, records: RecordCount, *, allowed: Mapping[tuple[str, str], Any],
                 refusal: str, torch_constants: bool = False,
                 persistent_load: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self._where = where
        self._records = records
        self._allowed = allowed
        self._refusal = refusal
        self._torch_constants = torch_constants
        self._persistent = persistent_load

    def find_class(self, module: str, name: str):
        obj = self._allowed.get((module, name))
        if obj is None and module == "torch" and self._torch_constants:
            obj = TORCH_CONSTANTS.get(name)
        if obj is None:
            raise UnsafePickleError(
                f"{self._where}: refused global {module}.{name}: {self._refusal}; this pickle would import "
                "something else (possibly to run code), nothing of it was executed")
        return obj.bind(self._records) if isinstance(obj, Call) else obj

    def persistent_load(self, pid):
        if self._persistent is None:
            raise UnsafePickleError(f"{self._where}: refused persistent id {reprlib.repr(pid)} (this pickle "
                                    "has none)")
        return self._persistent(pid)


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


def check_memo_indices(data: bytes, *, where: str, error: type[ShardfmtError]) -> None:
    """Refuse (``error``) a pickle that stores into the memo at an index past its own offset in the file.

    CPython's unpickler keeps its memo in an array it grows to twice the largest index
    ``PUT``/``LONG_BINPUT`` name, so nine bytes could make it allocate 64 GiB; honest writers
    number the memo from 0 upwards (or implicitly, ``MEMOIZE``). The scan reads opcodes as the
    unpickler does and stops at ``STOP`` or where the unpickler fails.
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
            raise error(f"{where}: the pickle stores into memo index {index} at byte {i}: an index past "
                        "its offset makes the unpickler allocate memory for it; refused")
        i = nxt


def restricted_loads(data: bytes, *, where: str, error: type[ShardfmtError], what: str,
                     records: RecordCount | None = None, **unpickler: Any) -> Any:
    """Unpickle ``data`` through ``RestrictedUnpickler(**unpickler)``; refuse with ``UnsafePickleError``
    (a refused global) or ``error`` (anything else: ``what`` names the kind of pickle expected).

    ``records`` counts what the reconstructors build (a fresh count for ``data`` when None).
    """
    check_memo_indices(data, where=where, error=error)
    if records is None:
        records = RecordCount(len(data), where, error=error)
    try:
        return RestrictedUnpickler(data, where, records, **unpickler).load()
    except ShardfmtError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a hostile or broken pickle is one error
        raise error(f"{where}: not a readable {what} pickle ({type(e).__name__}: {e})") from None


__all__ = ["BYTES_PER_RECORD", "MAX_NDIM", "RECORD_ALLOWANCE", "TORCH_CONSTANTS", "TORCH_DTYPES", "Call",
           "Constant", "Record", "RecordCount", "RestrictedUnpickler", "check_memo_indices", "ordered_dict",
           "record_cap", "record_type", "restricted_loads", "size"]
