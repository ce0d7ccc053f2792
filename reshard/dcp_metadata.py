"""Read a torch.distributed.checkpoint ``.metadata`` file without running any code from it.

DCP writes its metadata with ``pickle.dump``: loading it with ``pickle.load`` lets the file
call any importable function (the ``__reduce__`` trick). This module unpickles it with a
``pickle.Unpickler`` whose ``find_class`` admits an explicit allowlist, and even those
globals never resolve to the real objects:

- DCP's metadata classes (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
  ``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``,
  ``filesystem._StorageInfo``) become inert ``_Record`` stand-ins that only keep the state
  pickle hands them. The real classes are never touched, so a pickle cannot construct them
  with odd arguments or ``BUILD`` attributes onto them (on a class itself, ``BUILD`` fails).
- ``torch.Size``, ``_MEM_FORMAT_ENCODING``, ``torch.serialization._get_layout`` and the
  ``pathlib`` path classes become small checked functions returning tuples, ints and markers
  (a path becomes an inert marker: the import never reads DCP's ``storage_meta``);
  ``torch.<dtype>`` / ``torch.<layout>`` / ``torch.<memory_format>`` constants become
  ``_Constant`` markers, looked up in a table built from torch's namespace by type, never by
  ``getattr`` on a name from the file; ``collections.OrderedDict`` becomes ``dict`` (called
  without arguments, as an OrderedDict pickles).
- Every other global, including dotted names that would walk attributes, is refused with
  ``UnsafePickleError`` naming the file and the global, before anything of it runs.

The stand-ins are then checked field by field into frozen records (``DcpMetadata``): every
integer is an integer in range, every file name a plain name in the checkpoint directory.

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
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardfmt.errors import DcpImportError, UnsafePickleError

MAX_INT = 1 << 62
MAX_DIM = 1 << 53
MAX_NDIM = 64  # dims of a torch.Size
BYTES_PER_RECORD = 4  # an honest .metadata spends at least this much per record (module docstring)
RECORD_ALLOWANCE = 4096  # records any .metadata may build on top of that
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


def record_cap(nbytes: int) -> int:
    """The most records a ``.metadata`` of ``nbytes`` bytes may build or visit."""
    return RECORD_ALLOWANCE + nbytes // BYTES_PER_RECORD


class _Records:
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


class _Record:
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


def _record_type(kind: str) -> type[_Record]:
    return type(f"_{kind}Record", (_Record,), {"__slots__": (), "kind": kind})


class _Constant:
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

    Bound to one file's ``_Records`` (``bind``), it counts each call as one record per
    argument (at least one) before running: a memoised argument tuple can be passed again
    for a few bytes.
    """

    __slots__ = ("label", "fn", "records")

    def __init__(self, label: str, fn, records: _Records | None = None) -> None:
        self.label = label
        self.fn = fn
        self.records = records

    def bind(self, records: _Records) -> _Call:
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


_TORCH_CONSTANTS: dict[str, _Constant] = {}
_TORCH_DTYPES: dict[str, torch.dtype] = {}
for _name, _obj in sorted(vars(torch).items()):
    if isinstance(_obj, torch.dtype):
        _TORCH_CONSTANTS[_name] = _Constant("dtype", _name)
        _TORCH_DTYPES[_name] = _obj
    elif isinstance(_obj, torch.layout):
        _TORCH_CONSTANTS[_name] = _Constant("layout", _name)
    elif isinstance(_obj, torch.memory_format):
        _TORCH_CONSTANTS[_name] = _Constant("memory_format", _name)


_LAYOUTS = {f"torch.{name}": const for name, const in _TORCH_CONSTANTS.items() if const.kind == "layout"}
_UNREAD = _Unread()


def _get_layout(name) -> _Constant:
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
    def __init__(self, data: bytes, where: str, records: _Records) -> None:
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


def restricted_loads(data: bytes, *, where: str, records: _Records | None = None) -> Any:
    """Unpickle ``data`` admitting only ``ALLOWED_GLOBALS``; raise UnsafePickleError otherwise.

    ``records`` counts what the reconstructors build (a fresh count for ``data`` when None).
    """
    _check_memo_indices(data, where=where)
    try:
        return _RestrictedUnpickler(data, where, _Records(len(data), where) if records is None else records).load()
    except DcpImportError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a hostile or broken pickle is one error
        raise DcpImportError(f"{where}: not a readable DCP metadata pickle ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- checked records


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpChunk:
    """One saved slice of a tensor: ``offsets`` and ``sizes`` in its global coordinates."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpTensor:
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpLocation:
    """Where one item's bytes are: ``[offset, offset + length)`` of ``relative_path``."""

    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DcpMetadata:
    """What a DCP ``.metadata`` says, checked.

    ``locations`` is keyed by ``(fqn, chunk offsets)`` for tensor chunks and ``(fqn, None)``
    for bytes items (non-tensor values), as DCP's ``MetadataIndex`` is.
    """

    tensors: Mapping[str, DcpTensor]
    values: tuple[str, ...]
    locations: Mapping[tuple[str, tuple[int, ...] | None], DcpLocation]
    version: str | None = None
    paths: Mapping[str, tuple[str | int, ...]] | None = None  # key -> path in the saved state dict


def _paths(planner_data: Any, keys: set[str]) -> dict[str, tuple[str | int, ...]] | None:
    """DefaultSavePlanner's flatten mapping (key -> path of dict keys and list indices), if intact.

    It is planner-specific: anything but a mapping of every key to a path whose dotted join
    is that key gives None (the keys are then used as they are).
    """
    if not isinstance(planner_data, dict) or not keys <= set(planner_data):
        return None
    out = {}
    for key in keys:
        path = planner_data[key]
        if (not isinstance(path, tuple) or not path or len(path) > 64
                or not all(isinstance(p, str) or type(p) is int and 0 <= p <= MAX_INT for p in path)
                or ".".join(map(str, path)) != key):  # (str() of an int past 4300 digits raises)
            return None
        out[key] = path
    return out


def _describe(obj: Any) -> str:
    if isinstance(obj, _Record):
        return f"DCP {obj.kind}"
    if isinstance(obj, _Constant):
        return repr(obj)
    return type(obj).__name__


def _state(obj: Any, kind: str, where: str) -> Any:
    if not isinstance(obj, _Record) or obj.kind != kind:
        raise DcpImportError(f"{where}: expected a DCP {kind}, found {_describe(obj)}")
    return obj.state


def _fields(obj: Any, kind: str, where: str, required: tuple[str, ...]) -> dict:
    state = _state(obj, kind, where)
    if state is None:
        state = {}
    if isinstance(state, tuple) and len(state) == 2 and state[0] is None and isinstance(state[1], dict):
        state = state[1]  # (no __dict__, slot state)
    if not isinstance(state, dict):  # only named fields are read: its other keys are never walked
        raise DcpImportError(f"{where}: DCP {kind} has state of type {type(state).__name__}, expected its fields")
    missing = [f for f in required if f not in state]
    if missing:
        raise DcpImportError(f"{where}: DCP {kind} lacks field(s) {missing}")
    return state


def _int(value: Any, where: str, *, hi: int = MAX_INT) -> int:
    if type(value) is not int or not 0 <= value <= hi:
        raise DcpImportError(f"{where}: expected an integer in [0, {hi}], found {value!r}")
    return value


def _dims(value: Any, where: str) -> tuple[int, ...]:
    if type(value) is not tuple or len(value) > MAX_NDIM:
        raise DcpImportError(f"{where}: expected a torch.Size of at most {MAX_NDIM} dims, found {_describe(value)}")
    for v in value:
        _int(v, where, hi=MAX_DIM)
    return value  # kept, not copied: a memoised tuple may be visited many times


def _str(value: Any, where: str, *, limit: int = 4096) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise DcpImportError(f"{where}: expected a string of at most {limit} characters, found {_describe(value)}")
    return value


def _dtype(props: Any, where: str) -> torch.dtype:
    state = _state(props, "TensorProperties", where)
    if isinstance(state, tuple) and len(state) == 5:  # TensorProperties.__getstate__
        const, layout = state[0], state[1]
    else:
        fields = _fields(props, "TensorProperties", where, ("dtype",))
        const, layout = fields["dtype"], fields.get("layout")
    if not isinstance(const, _Constant) or const.kind != "dtype":
        raise DcpImportError(f"{where}: dtype is {_describe(const)}, not a torch dtype")
    if layout is not None and (not isinstance(layout, _Constant) or layout.name != "strided"):
        raise DcpImportError(f"{where}: layout {_describe(layout)} is not supported (only torch.strided)")
    return _TORCH_DTYPES[const.name]


def _tensor(fqn: str, obj: Any, where: str, records: _Records) -> DcpTensor:
    f = _fields(obj, "TensorStorageMetadata", where, ("properties", "size", "chunks"))
    shape = _dims(f["size"], f"{where}: size")
    chunks = f["chunks"]
    if not isinstance(chunks, list):
        raise DcpImportError(f"{where}: chunks is a {_describe(chunks)}, expected a list")
    records.add(len(chunks), f"{len(chunks)} chunks of tensor {fqn!r}")
    out = []
    for i, c in enumerate(chunks):
        cw = f"{where}: chunk {i}"
        cf = _fields(c, "ChunkStorageMetadata", cw, ("offsets", "sizes"))
        chunk = DcpChunk(offsets=_dims(cf["offsets"], f"{cw} offsets"), sizes=_dims(cf["sizes"], f"{cw} sizes"))
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape) or any(
                o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, shape)):
            raise DcpImportError(f"{cw}: slice {list(chunk.offsets)}+{list(chunk.sizes)} does not fit the "
                                 f"tensor's shape {list(shape)}")
        out.append(chunk)
    return DcpTensor(fqn=fqn, dtype=_dtype(f["properties"], f"{where}: properties"), shape=shape, chunks=tuple(out))


def _location(obj: Any, where: str, records: _Records) -> DcpLocation:
    f = _fields(obj, "_StorageInfo", where, ("relative_path", "offset", "length"))
    path = _str(f["relative_path"], f"{where}: relative_path", limit=255)
    if not _FILE_NAME.fullmatch(path) or ".." in path:
        raise DcpImportError(f"{where}: relative_path {path!r} is not a plain file name in the checkpoint "
                             "directory (refused: it could point outside it)")
    descs = f.get("transform_descriptors") or ()
    if not isinstance(descs, (list, tuple)):
        raise DcpImportError(f"{where}: transform_descriptors is a {_describe(descs)}, expected a list")
    records.add(len(descs), f"{len(descs)} transform descriptors")
    return DcpLocation(relative_path=path, offset=_int(f["offset"], f"{where}: offset"),
                       length=_int(f["length"], f"{where}: length"),
                       transforms=tuple(_str(d, f"{where}: transform descriptor", limit=256) for d in descs))


def parse_metadata(data: bytes, *, where: str) -> DcpMetadata:
    """Unpickle DCP metadata with the allowlist, then check it into a ``DcpMetadata``.

    Refuses the file once it builds or visits more than ``record_cap(len(data))`` records.
    """
    records = _Records(len(data), where)
    root = restricted_loads(data, where=where, records=records)
    f = _fields(root, "Metadata", where, ("state_dict_metadata", "storage_data"))
    sdm, sdata = f["state_dict_metadata"], f["storage_data"]
    if not isinstance(sdm, dict):
        raise DcpImportError(f"{where}: state_dict_metadata is a {_describe(sdm)}, expected a dict")
    if not isinstance(sdata, dict):
        raise DcpImportError(f"{where}: storage_data is a {_describe(sdata)}, expected a dict "
                             "(written by a storage writer other than DCP's FileSystemWriter?)")
    records.add(len(sdm), f"{len(sdm)} state_dict_metadata entries")
    records.add(len(sdata), f"{len(sdata)} storage_data entries")
    tensors: dict[str, DcpTensor] = {}
    values: list[str] = []
    for fqn, entry in sdm.items():
        fqn = _str(fqn, f"{where}: state_dict key")
        if isinstance(entry, _Record) and entry.kind == "BytesStorageMetadata":
            values.append(fqn)
        else:
            tensors[fqn] = _tensor(fqn, entry, f"{where}: tensor {fqn!r}", records)
    locations: dict[tuple[str, tuple[int, ...] | None], DcpLocation] = {}
    for index, info in sdata.items():
        ifields = _fields(index, "MetadataIndex", f"{where}: storage_data key", ("fqn",))
        fqn = _str(ifields["fqn"], f"{where}: storage_data key fqn")
        offset = ifields.get("offset")
        key = (fqn, None if offset is None else _dims(offset, f"{where}: storage_data {fqn!r} offset"))
        if key in locations:
            raise DcpImportError(f"{where}: storage_data lists {fqn!r} at offsets {key[1]} twice")
        locations[key] = _location(info, f"{where}: storage_data {fqn!r}", records)
    version = f.get("version")
    if version is not None:
        version = _str(version, f"{where}: version", limit=64)
    return DcpMetadata(tensors=tensors, values=tuple(values), locations=locations, version=version,
                       paths=_paths(f.get("planner_data"), set(tensors) | set(values)))


__all__ = [
    "ALLOWED_GLOBALS",
    "BYTES_PER_RECORD",
    "RECORD_ALLOWANCE",
    "DcpChunk",
    "DcpLocation",
    "DcpMetadata",
    "DcpTensor",
    "parse_metadata",
    "record_cap",
    "restricted_loads",
]
