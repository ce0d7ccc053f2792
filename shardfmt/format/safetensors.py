"""safetensors header encoding and offset math; no filesystem access here.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header + data. The
header maps each key to ``dtype``, ``shape`` and ``data_offsets`` (half-open, relative to
the start of the data). Data must be packed with no gap and cover the data section
exactly. We pad the header with spaces so the data starts on an 8-byte boundary, as the
reference writer does. A shard's absolute ``byte_range`` is ``8 + N + data_offsets``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson

from shardfmt.errors import HeaderError, ManifestError
from shardfmt.format import jsonscan
from shardfmt.format.dtypes import SUPPORTED_DTYPES, itemsize

PREFIX_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
ALIGNMENT = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderEntry:
    """One tensor in a safetensors header, with its absolute byte range in the file."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodedHeader:
    """A ready-to-write header: its bytes (with prefix) and every entry's placement."""

    data: bytes
    entries: tuple[HeaderEntry, ...]

    @property
    def file_size(self) -> int:
        return self.entries[-1].end if self.entries else len(self.data)


def encode_header(
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> EncodedHeader:
    """Lay out ``(key, dtype, shape)`` tensors in the given order and encode the header."""
    body: dict = {}
    if metadata:
        body["__metadata__"] = dict(metadata)
    rel = 0
    layout = []
    for key, dtype, shape in tensors:
        if key == "__metadata__" or key in body:
            raise HeaderError(f"duplicate or reserved safetensors key {key!r}")
        n = math.prod(shape) * itemsize(dtype)
        body[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [rel, rel + n]}
        layout.append((key, dtype, tuple(shape), rel, rel + n))
        rel += n
    js = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    pad = (-(PREFIX_BYTES + len(js))) % ALIGNMENT
    js += b" " * pad
    if len(js) > MAX_HEADER_BYTES:
        raise HeaderError(f"safetensors header of {len(js)} bytes exceeds {MAX_HEADER_BYTES}")
    data_start = PREFIX_BYTES + len(js)
    entries = tuple(
        HeaderEntry(key=k, dtype=d, shape=s, start=data_start + a, end=data_start + b)
        for k, d, s, a, b in layout
    )
    return EncodedHeader(data=struct.pack("<Q", len(js)) + js, entries=entries)


def header_length(prefix: bytes, *, source: str, file_size: int | None = None) -> int:
    """Return N from the 8-byte prefix, checked against the limit and the file size."""
    if len(prefix) < PREFIX_BYTES:
        raise HeaderError(f"{source}: file is {len(prefix)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:PREFIX_BYTES])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"{source}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if file_size is not None and PREFIX_BYTES + n > file_size:
        raise HeaderError(f"{source}: header length {n} runs past the end of the {file_size}-byte file")
    return n


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardOrigin:
    """Where a key's data sits in its global tensor (recorded in ``__metadata__``)."""

    fqn: str
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def encode_origins(origins: Mapping[str, ShardOrigin]) -> str:
    """Return the ``__metadata__["shards"]`` string: key -> fqn, offsets, global shape."""
    return orjson.dumps({k: {"fqn": o.fqn, "offsets": list(o.offsets), "global_shape": list(o.global_shape)}
                         for k, o in origins.items()}, option=orjson.OPT_SORT_KEYS).decode()


def decode_origins(metadata: Mapping[str, str], *, source: str) -> dict[str, ShardOrigin]:
    """Parse ``__metadata__["shards"]``; raise HeaderError if missing or malformed."""
    raw = metadata.get("shards")
    if raw is None:
        raise HeaderError(f"{source}: __metadata__ has no 'shards' entry (not a shardfmt data file?)")
    try:
        obj = jsonscan.load(raw.encode(), source=source)  # in pieces when large: entries become records as read
        if not (isinstance(obj, dict) or isinstance(obj, jsonscan.Lazy) and obj.kind == "object"):
            raise TypeError
        out = {}
        for k, o in obj.items():
            if not isinstance(o, dict) or set(o) != {"fqn", "offsets", "global_shape"}:
                raise TypeError
            fqn, offs, shape = o["fqn"], o["offsets"], o["global_shape"]
            if not isinstance(fqn, str) or not isinstance(offs, list) or not isinstance(shape, list) \
                    or not all(isinstance(x, int) and not isinstance(x, bool) for x in offs + shape):
                raise TypeError
            out[k] = ShardOrigin(fqn=fqn, offsets=tuple(offs), global_shape=tuple(shape))
        return out
    except (ManifestError, AttributeError, KeyError, TypeError):
        raise HeaderError(f"{source}: __metadata__['shards'] is malformed") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedHeader:
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]


def decode_header(raw: bytes, *, source: str, file_size: int) -> DecodedHeader:
    """Decode a header (``raw`` = prefix + JSON) and check it against safetensors' rules."""
    n = header_length(raw, source=source, file_size=file_size)
    js = raw[PREFIX_BYTES : PREFIX_BYTES + n]
    if len(js) != n:
        raise HeaderError(f"{source}: header truncated ({len(js)} of {n} bytes)")
    try:  # up to 100 MB of JSON: in pieces when large, so memory stays a few bytes per byte
        body = jsonscan.load(js, source=source)
    except ManifestError as e:
        raise HeaderError(f"{source}: header is not valid JSON ({e})") from None
    if not (isinstance(body, dict) or isinstance(body, jsonscan.Lazy) and body.kind == "object"):
        raise HeaderError(f"{source}: header is not a JSON object")
    try:
        out, metadata = _entries(body, source=source, data_start=PREFIX_BYTES + n, size=len(js))
    except ManifestError as e:  # JSON found malformed while walking a large header
        raise HeaderError(f"{source}: header is not valid JSON ({e})") from None
    pos = PREFIX_BYTES + n
    for e in sorted(out.values(), key=lambda e: (e.start, e.end)):
        if e.start != pos:
            raise HeaderError(f"{source}: tensor {e.key!r} starts at byte {e.start}, expected {pos} "
                              "(data must be packed without gaps or overlaps)")
        pos = e.end
    if pos != file_size:
        raise HeaderError(f"{source}: data ends at byte {pos} but the file has {file_size} bytes")
    return DecodedHeader(entries=out, metadata=metadata)


def _kept_metadata(lazy, budget) -> dict:
    out = {}
    for k, v in lazy.items():
        budget.charge(jsonscan.deep_size([k, v]), "__metadata__")
        out[k] = v
    return out


def _entries(body, *, source: str, data_start: int, size: int) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """The header's entries as records, and its ``__metadata__`` (charged to a budget when it is
    large: what it holds stays, as strings)."""
    out: dict[str, HeaderEntry] = {}
    metadata: dict[str, str] = {}
    for key, info in body.items():
        if key == "__metadata__":
            if isinstance(info, jsonscan.Lazy) and info.kind == "object":
                info = _kept_metadata(info, jsonscan.Budget.for_document(size, source))
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise HeaderError(f"{source}: __metadata__ must map strings to strings")
            metadata = info
            continue
        where = f"{source}: tensor {key!r}"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise HeaderError(f"{where}: entry must have exactly dtype, shape, data_offsets")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in SUPPORTED_DTYPES:
            raise HeaderError(f"{where}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise HeaderError(f"{where}: bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in offs)
                or offs[1] < offs[0]):
            raise HeaderError(f"{where}: bad data_offsets {offs!r}")
        if offs[1] - offs[0] != math.prod(shape) * itemsize(dtype):
            raise HeaderError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, "
                              f"shape {shape} of {dtype} needs {math.prod(shape) * itemsize(dtype)}")
        out[key] = HeaderEntry(key=key, dtype=dtype, shape=tuple(shape),
                               start=data_start + offs[0], end=data_start + offs[1])
    return out, metadata
