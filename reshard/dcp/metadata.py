"""Check what the restricted unpickler built from a DCP ``.metadata`` into frozen records.

``parse_metadata`` reads the inert stand-ins of ``reshard.dcp.unpickler`` field by field into
``DcpMetadata``: every integer is an integer in range, every file name a plain name in the
checkpoint directory, every dtype a torch dtype. Each record it visits counts towards the
file's ``record_cap`` (a memoised object may be reached many times for a few bytes); a state
is read by field name, never scanned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.dcp.unpickler import (
    MAX_NDIM,
    TORCH_DTYPES,
    Constant,
    Record,
    RecordCount,
    metadata_records,
    restricted_loads,
)
from reshard.errors import DcpImportError

MAX_INT = 1 << 62
MAX_DIM = 1 << 53
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


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
    if isinstance(obj, Record):
        return f"DCP {obj.kind}"
    if isinstance(obj, Constant):
        return repr(obj)
    return type(obj).__name__


def _state(obj: Any, kind: str, where: str) -> Any:
    if not isinstance(obj, Record) or obj.kind != kind:
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
    if not isinstance(const, Constant) or const.kind != "dtype":
        raise DcpImportError(f"{where}: dtype is {_describe(const)}, not a torch dtype")
    if layout is not None and (not isinstance(layout, Constant) or layout.name != "strided"):
        raise DcpImportError(f"{where}: layout {_describe(layout)} is not supported (only torch.strided)")
    return TORCH_DTYPES[const.name]


def _tensor(fqn: str, obj: Any, where: str, records: RecordCount) -> DcpTensor:
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


def _location(obj: Any, where: str, records: RecordCount) -> DcpLocation:
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
    records = metadata_records(len(data), where)
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
        if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
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


__all__ = ["DcpChunk", "DcpLocation", "DcpMetadata", "DcpTensor", "parse_metadata"]
