"""Read one ``torch.save`` zip file of a DeepSpeed checkpoint without running code from it.

``PtFile`` opens the zip through a byte store, unpickles ``<stem>/data.pkl`` with the shared
restricted unpickler (``reshard.unpickle``) under DeepSpeed's allowlist (``ALLOWED_GLOBALS``), and
turns every tensor into a ``TensorRef``: storage key, dtype, element offset, size and stride,
checked to lie inside its storage, whose zip entry is checked to hold exactly ``numel`` elements
and to lie inside the file. Tensor bytes are read later, by element range (``read``), so no
allocation follows a number from the file before it was checked against the file's size.

Allowlist (the notes' section 1.5): ``collections.OrderedDict`` (a dict; the ``_metadata`` that
``state_dict()`` attaches is dropped), ``torch.Size``, ``torch.<X>Storage`` for the numeric
storages, ``torch._utils._rebuild_tensor_v2``, ``torch._tensor._rebuild_from_type_v2`` with
``torch.Tensor`` (attributes such as ZeRO-3's ``ds_id`` are dropped), torch dtypes (a
``DynamicLossScaler`` keeps one), ``set``, and inert stand-ins for DeepSpeed's ``ZeroStageEnum``
(an int 0-3), ``LossScaler``, ``DynamicLossScaler`` and ``fragment_address``. Anything else
(``torch._utils._rebuild_parameter``, ``argparse.Namespace`` in a caller's ``client_state``) is
refused: the file is not read.

Trade-off: the zip's CRC-32s are checked by ``verify`` (streamed, one more read of every
storage), not on each ranged read.
"""

from __future__ import annotations

import pickle
import reprlib
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from reshard._shardfmt import Storage
from reshard.errors import DeepSpeedImportError
from reshard.unpickle import MAX_NDIM, Call, Record, record_type, restricted_loads, size

PICKLE_LIMIT = 1 << 30  # largest data.pkl read
_CRC_READ = 16 << 20
_STORAGES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
             "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageRef:
    """One storage of the file: zip entry ``data/<key>``, ``numel`` elements of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """A saved tensor: a strided view (``offset``, ``size``, ``stride`` in elements) into ``storage``."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.size:
            n *= d
        return n

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def is_flat(self) -> bool:
        """Elements ``[offset, offset + numel)`` of the storage, in order."""
        return all(st == 1 for d, st in zip(self.size, self.stride) if d != 1) and \
            sum(d != 1 for d in self.size) <= 1


class _StorageType:
    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype

    def __setstate__(self, state) -> None:
        raise pickle.UnpicklingError(f"cannot BUILD on torch.{self.name}")


class _TensorType:
    __slots__ = ()

    def __setstate__(self, state) -> None:
        raise pickle.UnpicklingError("cannot BUILD on torch.Tensor")


class ModuleDict(dict):
    """An ``OrderedDict`` as unpickled: a dict that accepts (and drops) ``state_dict()``'s ``_metadata``."""

    __slots__ = ()

    def __setstate__(self, state) -> None:
        if type(state) is not dict or set(state) - {"_metadata"}:
            raise pickle.UnpicklingError(f"OrderedDict BUILD with {reprlib.repr(state)}")


def _ordered_dict(*args) -> ModuleDict:
    if args:
        raise pickle.UnpicklingError(f"OrderedDict called with arguments {reprlib.repr(args)}")
    return ModuleDict()


def _is_dims(x) -> bool:
    return type(x) is tuple and len(x) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in x)


def _rebuild_tensor_v2(storage, offset, dims, stride, requires_grad, hooks, metadata=None) -> TensorRef:
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0 or not _is_dims(dims) \
            or not _is_dims(stride) or len(dims) != len(stride) or type(requires_grad) is not bool \
            or hooks != {} or metadata not in (None, {}):
        raise pickle.UnpicklingError(f"_rebuild_tensor_v2 of {reprlib.repr((offset, dims, stride))}")
    ref = TensorRef(storage=storage, offset=offset, size=dims, stride=stride)
    last = offset + sum((d - 1) * s for d, s in zip(dims, stride)) if ref.numel else offset - 1
    if last >= storage.numel:
        raise pickle.UnpicklingError(f"tensor of size {list(dims)} stride {list(stride)} at offset {offset} "
                                     f"runs past its storage {storage.key!r} of {storage.numel} elements")
    return ref


def _rebuild_from_type_v2(func, new_type, args, state) -> TensorRef:
    if not (isinstance(func, Call) and func.fn is _rebuild_tensor_v2) or not isinstance(new_type, _TensorType) \
            or type(args) is not tuple or type(state) is not dict:
        raise pickle.UnpicklingError("_rebuild_from_type_v2 other than of a plain tensor")
    return func(*args)  # attributes in ``state`` (ZeRO-3's ds_id) are not needed


def _zero_stage(value) -> int:
    if type(value) is not int or not 0 <= value <= 3:
        raise pickle.UnpicklingError(f"ZeroStageEnum({value!r})")
    return value


def _set(items=()) -> frozenset:
    if type(items) is not list or not all(type(x) in (str, int) for x in items):
        raise pickle.UnpicklingError(f"set of {reprlib.repr(items)}")
    return frozenset(items)


_DS = "deepspeed"
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): Call("OrderedDict", _ordered_dict),
    ("torch", "Size"): Call("torch.Size", size),
    ("torch", "Tensor"): _TensorType(),
    ("torch._utils", "_rebuild_tensor_v2"): Call("_rebuild_tensor_v2", _rebuild_tensor_v2),
    ("torch._tensor", "_rebuild_from_type_v2"): Call("_rebuild_from_type_v2", _rebuild_from_type_v2),
    ("__builtin__", "set"): Call("set", _set),
    ("builtins", "set"): Call("set", _set),
    (f"{_DS}.runtime.zero.config", "ZeroStageEnum"): Call("ZeroStageEnum", _zero_stage),
    (f"{_DS}.runtime.fp16.loss_scaler", "LossScaler"): record_type("LossScaler"),
    (f"{_DS}.runtime.fp16.loss_scaler", "DynamicLossScaler"): record_type("DynamicLossScaler"),
    (f"{_DS}.utils.tensor_fragment", "fragment_address"): record_type("fragment_address"),
    **{("torch", name): _StorageType(name, dtype) for name, dtype in _STORAGES.items()},
}
_REFUSAL = ("a DeepSpeed checkpoint file may only name torch's tensor rebuilders, storages, torch.Size and "
            "dtypes, OrderedDict, set and DeepSpeed's ZeroStageEnum, LossScaler and fragment_address")


class _RangeFile:
    """A read-only, seekable file over one object of a byte store (what ``zipfile`` needs)."""

    def __init__(self, reader, size: int) -> None:
        self._reader = reader
        self._size = size
        self._pos = 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = max(0, pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos)
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        buf = bytearray(max(0, end - self._pos))
        if buf:
            self._reader.readinto(self._pos, [memoryview(buf)])
        self._pos += len(buf)
        return bytes(buf)


class PtFile:
    """One ``torch.save`` zip: ``load()`` its pickle, ``read()`` element ranges of its tensors."""

    def __init__(self, storage: Storage, root: str, path: str) -> None:
        """Open ``path`` (a file under ``root``) and read its zip directory."""
        self.path = path
        self.size = storage.size(self.path, within=root)
        self._reader = storage.open_reader(self.path, self.size, within=root)
        self._starts: dict[str, int] = {}
        self._storages: dict[str, StorageRef] = {}
        self.bytes_read = 0
        try:
            self._zip = zipfile.ZipFile(_RangeFile(self._reader, self.size))  # type: ignore[arg-type]
            pkls = [i for i in self._zip.infolist() if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            self.close()
            raise DeepSpeedImportError(f"{self.path}: not a torch.save zip file ({e})") from None
        if len(pkls) != 1:
            self.close()
            raise DeepSpeedImportError(f"{self.path}: not a torch.save zip file (no single <name>/data.pkl entry)")
        self._pkl = pkls[0]
        self._prefix = self._pkl.filename[: -len("data.pkl")]

    def load(self) -> Any:
        """Unpickle ``data.pkl`` through the allowlist; tensors come back as ``TensorRef``."""
        if self._pkl.file_size > min(PICKLE_LIMIT, self.size):
            raise DeepSpeedImportError(f"{self.path}: data.pkl claims {self._pkl.file_size} bytes in a file of "
                                       f"{self.size}")
        try:
            data = self._zip.read(self._pkl)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
            raise DeepSpeedImportError(f"{self.path}: corrupt data.pkl ({e})") from None
        return restricted_loads(data, where=self.path, error=DeepSpeedImportError, what="torch.save",
                                allowed=ALLOWED_GLOBALS, refusal=_REFUSAL, torch_constants=True,
                                persistent_load=self._persistent_load)

    def _persistent_load(self, pid) -> StorageRef:
        if type(pid) is not tuple or len(pid) != 5 or pid[0] != "storage" or not isinstance(pid[1], _StorageType) \
                or type(pid[2]) is not str or type(pid[3]) is not str or type(pid[4]) is not int or pid[4] < 0:
            raise pickle.UnpicklingError(f"persistent id {reprlib.repr(pid)} (expected a torch storage)")
        _, kind, key, _location, numel = pid
        ref = self._storages.get(key)
        if ref is None:
            itemsize = torch.empty((), dtype=kind.dtype).element_size()
            start, length = self._entry(key)
            if length != numel * itemsize:
                raise pickle.UnpicklingError(f"storage {key!r} of {numel} {kind.dtype} elements is {length} bytes "
                                             f"in the file, not {numel * itemsize}")
            ref = self._storages[key] = StorageRef(key=key, dtype=kind.dtype, numel=numel)
        elif (ref.dtype, ref.numel) != (kind.dtype, numel):
            raise pickle.UnpicklingError(f"storage {key!r} named twice with different types or sizes")
        return ref

    def _entry(self, key: str) -> tuple[int, int]:
        """Where storage ``key``'s bytes start in the file, and how many there are (a STORED zip entry)."""
        name = f"{self._prefix}data/{key}"
        try:
            info = self._zip.getinfo(name)
        except KeyError:
            raise pickle.UnpicklingError(f"no zip entry {name!r} for storage {key!r}") from None
        head = _RangeFile(self._reader, self.size)
        head.seek(info.header_offset)
        local = head.read(30)
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size \
                or len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise pickle.UnpicklingError(f"zip entry {name!r} is not stored uncompressed")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        if start + info.file_size > self.size:
            raise pickle.UnpicklingError(f"zip entry {name!r} runs past the end of the file ({self.size} bytes)")
        self._starts[key] = start
        return start, info.file_size

    def read(self, ref: TensorRef, start: int = 0, count: int | None = None) -> torch.Tensor:
        """Elements ``[start, start + count)`` of flat tensor ``ref`` (all of any tensor when both are
        left out), as a new CPU tensor; a non-flat tensor comes back with its shape."""
        itemsize = torch.empty((), dtype=ref.dtype).element_size()
        if count is None and start == 0 and not ref.is_flat():
            lo, n = ref.offset, (ref.offset + sum((d - 1) * s for d, s in zip(ref.size, ref.stride)) + 1 - ref.offset
                                 if ref.numel else 0)
            flat = self._read_elements(ref.storage, lo, n, itemsize)
            return torch.as_strided(flat, ref.size, ref.stride) if ref.numel else torch.empty(ref.size, dtype=ref.dtype)
        count = ref.numel - start if count is None else count
        if not ref.is_flat() or start < 0 or count < 0 or start + count > ref.numel:
            raise DeepSpeedImportError(f"{self.path}: elements [{start}, {start + count}) of a tensor of size "
                                       f"{list(ref.size)} stride {list(ref.stride)}: not a range of a flat tensor")
        out = self._read_elements(ref.storage, ref.offset + start, count, itemsize)
        return out.view(ref.size) if (start, count) == (0, ref.numel) else out

    def _read_elements(self, st: StorageRef, first: int, n: int, itemsize: int) -> torch.Tensor:
        buf = bytearray(n * itemsize)
        if buf:
            self._reader.readinto(self._starts[st.key] + first * itemsize, [memoryview(buf)])
            self.bytes_read += len(buf)
            return torch.frombuffer(buf, dtype=st.dtype)
        return torch.empty(0, dtype=st.dtype)

    def verify(self) -> None:
        """Check the CRC-32 the zip records for every storage this file's pickle named (streamed)."""
        for key in sorted(self._storages):
            info = self._zip.getinfo(f"{self._prefix}data/{key}")
            if info.CRC == 0 and info.file_size == 0:
                continue
            crc, pos, end = 0, self._starts[key], self._starts[key] + info.file_size
            while pos < end:
                buf = bytearray(min(_CRC_READ, end - pos))
                self._reader.readinto(pos, [memoryview(buf)])
                crc = zlib.crc32(buf, crc)
                pos += len(buf)
            self.bytes_read += info.file_size
            if crc != info.CRC:
                raise DeepSpeedImportError(f"{self.path}: storage {key!r} fails its zip CRC-32 (corrupt bytes)")

    def close(self) -> None:
        self._reader.close()


def is_record(obj: Any, kind: str) -> bool:
    return isinstance(obj, Record) and obj.kind == kind


__all__ = ["ALLOWED_GLOBALS", "PICKLE_LIMIT", "ModuleDict", "PtFile", "StorageRef", "TensorRef", "is_record"]
