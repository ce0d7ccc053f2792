"""Large JSON documents parsed in bounded pieces: a manifest's memory stays a small multiple of its size.

One ``orjson.loads`` of a whole document costs up to ~30 bytes of memory per byte of text: a
``[]`` or ``{}`` is 3 bytes of JSON and 64-200 bytes of Python objects, a one-character string
4 bytes and 56. A manifest's author chooses that text, so a reader that parsed a 1 GiB manifest
in one call could be made to hold tens of GB. Here a document larger than ``PIECE_MAX`` is
parsed as ``Lazy`` containers instead: a vectorised scan (numpy, in blocks, carrying the string,
escape and depth state) finds where a container's members lie without building them, and the
members are parsed in batches of at most ``PIECE_MAX`` bytes when the caller walks them (and
turns them into records). A member larger than ``PIECE_MAX`` is itself ``Lazy`` when it is a
container, and parsed in one call otherwise (a string costs at most 4 bytes per byte of text).

What the caller keeps as plain JSON (free-form typed JSON: metadata, values) is charged to a
``Budget`` with a pessimistic estimate of the memory its text can take (``estimate``) before it
is parsed; the records the caller builds from the rest are bounded by their own structure.

Trade-off: a split container's bytes are scanned once more (numpy, in the order of 1 GB/s) on
top of the parse, and its member positions are kept (8 bytes each); a document of at most
``PIECE_MAX`` bytes is parsed in one call as before. Splitting a document into its members and
parsing each with orjson accepts the valid JSON and nothing else, as long as every member is
walked: each piece is checked by orjson, the bytes between pieces by the scan (brackets,
separators, one colon per object member, no empty array member). Callers walk each container
once and refuse a record field given twice (an earlier duplicate would go unread).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import orjson

from shardfmt.errors import ManifestError

MAX_DEPTH = 64  # a manifest's JSON nesting (metadata and values included; spec section 4)
PIECE_MAX = 1 << 20  # bytes of JSON parsed in one call: at most ~32 MiB of objects, whatever they are
KEPT_PER_BYTE = 5  # plain JSON a manifest keeps (metadata, values): bytes of objects per byte of manifest...
KEPT_EXTRA = 32 << 20  # ... plus this much
SCAN_BLOCK = 1 << 18  # bytes scanned per numpy step (its arrays: ~8 bytes per byte scanned)

_WS = np.zeros(256, dtype=bool)
_WS[[0x20, 0x09, 0x0A, 0x0D]] = True
_STEP = np.zeros(256, dtype=np.int8)  # nesting change of a byte outside strings
_STEP[[0x5B, 0x7B]] = 1
_STEP[[0x5D, 0x7D]] = -1
_BS, _QUOTE, _COMMA, _COLON = 0x5C, 0x22, 0x2C, 0x3A


def estimate(text: bytes) -> int:
    """An upper bound on the bytes of Python objects ``orjson.loads(text)`` allocates at its peak
    (CPython 3.11, 64-bit; checked by the test suite, one kind of text per fresh process): per
    ``{`` 208, ``[`` 96, string 88, ``,`` 64 and ``:`` 96 (a separator may precede a number: a
    float takes 60 bytes at the peak), plus 3 bytes per byte of text (long ASCII strings peak at
    2), 8 when it holds a character beyond ASCII, raw or escaped (strings of 4-byte characters
    peak at 5). Counted over the raw bytes, so characters inside strings count too; honest typed
    JSON stays within ~6x."""
    per_char = 3 if text.isascii() and b"\\u" not in text else 8
    return (208 * text.count(b"{") + 96 * text.count(b"[") + 88 * (text.count(b'"') // 2)
            + 64 * text.count(b",") + 96 * text.count(b":") + per_char * len(text))


@dataclass
class Budget:
    """What the plain JSON a parse keeps may cost: ``limit`` bytes of estimated objects in all."""

    limit: int
    source: str
    used: int = 0

    def charge(self, nbytes: int, where: str) -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise ManifestError(f"{self.source}: {where}: the JSON kept from this file (metadata, values) would "
                                f"take more than {self.limit} bytes of memory: at most {KEPT_PER_BYTE} bytes per "
                                f"byte of the file, plus {KEPT_EXTRA >> 20} MiB")

    @classmethod
    def for_document(cls, size: int, source: str) -> Budget:
        return cls(limit=KEPT_PER_BYTE * size + KEPT_EXTRA, source=source)


def _loads(text, what: str, source: str):
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise ManifestError(f"{source}: {what}: not valid JSON ({e})") from None


class Lazy:
    """A JSON object or array too large to parse in one call, at nesting ``depth`` (top level:
    1). Its members are walked once, in document order (``items()`` for an object, iteration for
    an array): one scan finds where they lie (on first use), and they are parsed in batches of at
    most ``PIECE_MAX`` bytes. Callers turn an object into a dict of its members (few, for a
    record) or walk it (a map), never look members up by name: every member is parsed once."""

    __slots__ = ("buf", "start", "end", "kind", "depth", "source", "_bounds", "_colons")

    def __init__(self, buf: bytes, start: int, end: int, depth: int, source: str) -> None:
        self.buf, self.start, self.end, self.depth, self.source = buf, start, end, depth, source
        first = _first_non_ws(np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start), 0)
        if first is None or buf[start + first] not in b"[{":
            raise ManifestError(f"{source}: not valid JSON (expected an object or array)")
        self.kind = "object" if buf[start + first] == 0x7B else "array"
        self._bounds: np.ndarray | None = None  # opening bracket, the container's own commas, closing bracket
        self._colons: np.ndarray | None = None  # each member's colon (objects); offsets from ``start``

    def __repr__(self) -> str:
        return f"<JSON {self.kind} of {self.size} bytes>"

    @property
    def size(self) -> int:
        return self.end - self.start

    def _scanned(self) -> np.ndarray:
        if self._bounds is None:
            self._bounds, self._colons = _scan(self.buf, self.start, self.end, self.kind, self.source)
        return self._bounds

    def __len__(self) -> int:
        return len(self._scanned()) - 1

    def _value_span(self, i: int) -> tuple[int, int]:
        lo = self._colons[i] if self.kind == "object" else self._bounds[i]
        return self.start + int(lo) + 1, self.start + int(self._bounds[i + 1])

    def _key(self, i: int) -> str:
        lo, hi = self.start + int(self._bounds[i]) + 1, self.start + int(self._colons[i])
        first = _first_non_ws(np.frombuffer(self.buf, dtype=np.uint8, count=hi - lo, offset=lo), 0)
        if first is None or self.buf[lo + first] != _QUOTE:  # parsed only when it is a string
            raise ManifestError(f"{self.source}: not valid JSON (an object key that is not a string)")
        return _loads(memoryview(self.buf)[lo:hi], "a key", self.source)

    def items(self) -> Iterator[tuple[str, object]]:
        """(key, value) in document order: small values parsed in batches, large ones Lazy."""
        self._require("object")
        return self._walk()

    def __iter__(self) -> Iterator[object]:
        self._require("array")
        return (v for _, v in self._walk())

    def text(self) -> memoryview:
        return memoryview(self.buf)[self.start:self.end]

    def _require(self, kind: str) -> None:
        if self.kind != kind:
            raise ManifestError(f"{self.source}: expected an {kind}, found an {self.kind} of {self.size} bytes")

    def _walk(self) -> Iterator[tuple[str | None, object]]:
        obj = self.kind == "object"
        n, i = len(self), 0
        while i < n:
            lo, hi = self._value_span(i)
            if hi - lo > PIECE_MAX:
                yield (self._key(i) if obj else None), value_at(self.buf, lo, hi, self.depth + 1, self.source)
                i += 1
                continue
            first = self.start + int(self._bounds[i]) + 1
            j = i + 1
            while j < n and self._value_span(j)[1] - first <= PIECE_MAX:
                j += 1
            last = self.start + int(self._bounds[j])
            text = self.buf[first:last]
            run = _loads(b"{" + text + b"}" if obj else b"[" + text + b"]", "a value", self.source)
            if obj:
                for k in range(i, j):
                    key = self._key(k)
                    yield key, run[key]  # duplicate keys in one batch: the parsed dict holds the last
            elif len(run) != j - i:  # an empty member ("[,1]") parses as none
                raise ManifestError(f"{self.source}: not valid JSON (an empty array member)")
            else:
                yield from ((None, v) for v in run)
            i = j


def value_at(buf: bytes, start: int, end: int, depth: int, source: str):
    """The value in ``buf[start:end]`` at nesting ``depth``: parsed if it is at most
    ``PIECE_MAX`` bytes, else ``Lazy``. Members are not checked for nesting here: what the
    caller turns into records is type-checked, what it keeps goes through ``plain``."""
    if end - start <= PIECE_MAX or not _is_container(buf, start, end):
        return _loads(memoryview(buf)[start:end], "a value", source)  # a string costs <= 4x its text
    return Lazy(buf, start, end, depth, source)


def _is_container(buf: bytes, start: int, end: int) -> bool:
    arr = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start)
    first = _first_non_ws(arr, 0)
    return first is not None and arr[first] in (0x5B, 0x7B)


def load(buf: bytes, *, source: str):
    """Parse a JSON document: in one call, nesting checked, when it is at most ``PIECE_MAX``
    bytes; else as a ``Lazy`` top-level container whose members the caller walks."""
    if len(buf) <= PIECE_MAX or not _is_container(buf, 0, len(buf)):
        value = _loads(buf, "the document", source)
        if isinstance(value, (dict, list)) and bracket_depth(buf) < MAX_DEPTH:
            return value  # no container as deep as the limit: nothing can reach past it
        return check_depth_at(value, 1, source)
    return Lazy(buf, 0, len(buf), 1, source)


def plain(value, budget: Budget, where: str, *, depth: int):
    """``value`` (at nesting ``depth``) as plain JSON, checked for nesting and charged to
    ``budget``: a parsed one by what it holds, a Lazy one by the estimate from its text, before
    it is parsed whole."""
    if isinstance(value, Lazy):
        text = value.text()
        budget.charge(estimate(bytes(text)), where)
        value = _loads(text, where, value.source)
    else:
        budget.charge(deep_size(value), where)
    return check_depth_at(value, depth, budget.source)


def deep_size(value) -> int:
    """Bytes of the Python objects a parsed JSON value holds (shared ones counted each time)."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        total += sys.getsizeof(v)
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def check_depth_at(value, depth: int, source: str):
    """Refuse ``value`` when, sitting at nesting ``depth``, it reaches past the manifest's limit."""
    if isinstance(value, (dict, list)):
        check_depth(value, source=source, limit=MAX_DEPTH - depth + 1)
    return value


def check_depth(obj, *, source: str, limit: int = MAX_DEPTH) -> None:
    """Refuse JSON nested deeper than ``limit`` (the top level is at depth 1, and a scalar one
    level below its container): iteratively, holding the containers of the current path only."""
    if limit < 1 or (limit == 1 and isinstance(obj, (dict, list)) and obj):
        raise ManifestError(f"{source}: JSON nested deeper than {limit} levels")
    if not isinstance(obj, (dict, list)):
        return
    stack = [iter(_containers(obj))]
    while stack:
        v = next(stack[-1], _END)
        if v is _END:
            stack.pop()
            continue
        if len(stack) + 1 >= limit and (len(stack) + 1 > limit or v):
            raise ManifestError(f"{source}: JSON nested deeper than {limit} levels")
        stack.append(iter(_containers(v)))


def _containers(v) -> list:
    return [x for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list))]


_END = object()


def _scan(buf: bytes, start: int, end: int, kind: str, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(bounds, colons) of the container in ``buf[start:end]``: ``bounds`` holds the offsets
    (from ``start``) of its opening bracket, its own commas and its closing bracket; ``colons``
    each member's colon (objects). uint32: a manifest is at most 1 GiB."""
    arr = np.frombuffer(buf, dtype=np.uint8, count=end - start, offset=start)
    first = _first_non_ws(arr, 0)
    commas, colons, close = _separators(arr, first)
    closer = 0x7D if kind == "object" else 0x5D
    bad = close is None or arr[close] != closer or _first_non_ws(arr, close + 1) is not None
    if not bad and not len(commas) and _first_non_ws(arr[:close], first + 1) is None:
        return np.array([first], dtype=np.uint32), np.zeros(0, dtype=np.uint32)  # empty: no members
    bounds = None if bad else np.concatenate((np.array([first], dtype=np.uint32), commas,
                                              np.array([close], dtype=np.uint32)))
    del commas
    if not bad and kind == "object":  # exactly one colon per member, between its bounds
        bad = len(colons) != len(bounds) - 1 or bool(np.any(colons <= bounds[:-1]) or np.any(colons >= bounds[1:]))
    elif not bad:
        bad = len(colons) > 0
    if bad:
        raise ManifestError(f"{source}: not valid JSON (a container of {end - start} bytes is malformed)")
    return bounds, colons


def _first_non_ws(arr: np.ndarray, lo: int) -> int | None:
    """The position of the first byte at or after ``lo`` that is not JSON whitespace (None: none)."""
    for pos in range(lo, len(arr), SCAN_BLOCK):
        hit = np.flatnonzero(~_WS[arr[pos:pos + SCAN_BLOCK]])
        if len(hit):
            return pos + int(hit[0])
    return None


def _separators(arr: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """The container opening at ``arr[first]``: positions of its own commas and colons (those
    at nesting 1, outside strings) and of its closing bracket (None: it never closes)."""
    commas: list[np.ndarray] = []
    colons: list[np.ndarray] = []
    in_str, run, depth = 0, 0, 0  # carried across blocks: inside a string, backslashes before, nesting
    pos = first
    while pos < len(arr):
        blk = arr[pos:pos + SCAN_BLOCK]
        after, outside, run = _strings(blk, in_str, run)
        d = np.cumsum(_STEP[blk] * outside, dtype=np.int32) + depth
        here = outside & (d == 1)
        closed = np.flatnonzero(d <= 0)
        stop = int(closed[0]) if len(closed) else len(blk)
        commas.append((pos + np.flatnonzero(here[:stop] & (blk[:stop] == _COMMA))).astype(np.uint32))
        colons.append((pos + np.flatnonzero(here[:stop] & (blk[:stop] == _COLON))).astype(np.uint32))
        if len(closed):
            return np.concatenate(commas), np.concatenate(colons), pos + stop
        in_str, depth = int(after[-1]), int(d[-1])
        pos += len(blk)
    return np.concatenate(commas), np.concatenate(colons), None


def bracket_depth(buf: bytes) -> int:
    """The deepest nesting of brackets outside strings in a JSON text (vectorised: a header of
    thousands of entries is checked without walking its parsed objects)."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    in_str, run, depth, deepest = 0, 0, 0, 0
    for pos in range(0, len(arr), SCAN_BLOCK):
        blk = arr[pos:pos + SCAN_BLOCK]
        after, outside, run = _strings(blk, in_str, run)
        d = np.cumsum(_STEP[blk] * outside, dtype=np.int32) + depth
        deepest = max(deepest, int(d.max()))
        in_str, depth = int(after[-1]), int(d[-1])
    return deepest


def _strings(blk: np.ndarray, in_str: int, run: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(inside a string after each byte, neither in a string nor a quote, the backslashes ending
    the block) of a block, given whether it starts inside a string and the backslashes before it."""
    quote = (blk == _QUOTE).view(np.uint8)
    bs = blk == _BS
    if run or bs.any():
        quote = quote & ~_escaped(bs, run)
        run = _trailing_run(bs, run)
    after = np.bitwise_xor.accumulate(quote) ^ in_str
    return after, (after | quote) == 0, run


def _escaped(bs: np.ndarray, run: int) -> np.ndarray:
    """Whether each byte follows an odd run of backslashes (``run`` of them end the block before)."""
    idx = np.arange(len(bs))
    plain_before = np.maximum.accumulate(np.where(bs, -1, idx))
    runlen = np.where(bs, idx - plain_before + np.where(plain_before < 0, run, 0), 0)
    out = np.empty(len(bs), dtype=bool)
    out[0] = run % 2 == 1
    out[1:] = runlen[:-1] % 2 == 1
    return out.view(np.uint8)


def _trailing_run(bs: np.ndarray, run: int) -> int:
    """The backslashes ending the block (counting those carried in when it is all backslashes)."""
    plain = np.flatnonzero(~bs)
    return len(bs) - 1 - int(plain[-1]) if len(plain) else run + len(bs)
