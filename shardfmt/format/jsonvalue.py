"""Typed JSON for non-tensor values: exact round trips, and never any pickling.

Plain JSON carries ``None``, ``bool``, ``str``, 64-bit ``int``, finite ``float``, lists and
dicts with string keys. Everything else this module accepts is a one-key object whose
key starts with ``$`` (the tag):

==============  ===========================================================
``$tuple``      a tuple: a list of encoded items
``$dict``       a dict whose keys are not all plain strings (or a key starts
                with ``$``): a list of ``[key, value]`` pairs, both encoded
``$float``      ``"nan"``, ``"inf"`` or ``"-inf"``
``$int``        an int outside the signed 64-bit range, as a decimal string
``$bytes``      bytes, base64 (standard alphabet, padded)
``$ndarray``    ``{"dtype": numpy dtype str, "shape": [...], "data": base64}``,
                little-endian C order
``$npscalar``   ``{"dtype": ..., "data": base64}``: a numpy scalar
==============  ===========================================================

Because a plain dict never has a ``$`` key (such a dict is written as ``$dict``), a
one-key object with a ``$`` key is always a tag. Anything else is refused with an
``EncodingError`` naming the key: loading a checkpoint never runs code.
"""

from __future__ import annotations

import base64
import io
import math
import pickletools
import re
import warnings
from typing import Any

import numpy as np

from shardfmt.errors import EncodingError, ManifestError

_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1
_NP_KINDS = frozenset("biufc")  # numeric and bool numpy dtypes only (no object, no void)


MAX_DEPTH = 48  # nesting of one value; the manifest adds its own levels (limit 64 in all)


# Opcodes that push a string (or one from the memo): what STACK_GLOBAL takes its module and name from.
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
                      "SHORT_BINSTRING", "GET", "BINGET", "LONG_BINGET", "MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_IMPORT = re.compile(r"[A-Za-z_][\w.]* [A-Za-z_][\w.]*")  # GLOBAL's and INST's "module name"


def is_pickle(data: bytes | bytearray) -> bool:
    """Whether ``data`` is a pickle someone would unpickle: ``pickle.dumps`` output (protocol 2-5:
    the PROTO opcode first, STOP last; data loaders' states hold such bytes, torchtitan's);
    ``torch.save``'s zip (its ``data.pkl`` is one); or, in any protocol, a pickle that imports
    something (the only way one runs code): opcodes that parse (``pickletools.genops``, nothing
    built or run) through an import of a ``module name`` to STOP, with a stack that adds up
    (``pickletools.dis``). Random bytes (an RNG state) pass none of these but for a chance of
    about 1 in 4 million of the first (none of 300,000 random 64-byte strings passed the last)."""
    if len(data) >= 3 and data[0] == 0x80 and 2 <= data[1] <= 5 and data[-1:] == b".":
        return True
    head = bytes(data[:1024])
    if head[:4] == b"PK\x03\x04" and b"data.pkl" in head:
        return True
    return _imports_something(bytes(data))


def _imports_something(data: bytes) -> bool:
    with warnings.catch_warnings():  # pickletools decodes STRING arguments, warning on odd escapes
        warnings.simplefilter("ignore", DeprecationWarning)
        return _parses_to_an_import(data)


def _parses_to_an_import(data: bytes) -> bool:
    imports, before = False, ("", "")  # the two opcodes before this one
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(data)):
            if op.name in ("GLOBAL", "INST"):
                imports = imports or (isinstance(arg, str) and _IMPORT.fullmatch(arg) is not None)
            elif op.name == "STACK_GLOBAL":
                imports = imports or all(b in _STRINGS for b in before)
            before = (before[1], op.name)
            if op.name == "STOP":
                if imports:
                    pickletools.dis(data[:pos + 1], out=io.StringIO())  # raises when the stack does not add up
                return imports
    except Exception:  # noqa: BLE001 - any opcode stream that does not parse to STOP is no pickle
        return False
    return False


def holds_pickle(value: Any, _depth: int = 0) -> bool:
    """Whether ``value`` holds bytes ``is_pickle`` calls a pickle, as a value or a dict key at any
    depth; a value nested deeper than ``MAX_DEPTH`` counts as holding one (refused unread)."""
    if isinstance(value, (bytes, bytearray)):
        return is_pickle(value)
    if _depth > MAX_DEPTH:
        return isinstance(value, (dict, list, tuple))
    if isinstance(value, dict):
        return any(holds_pickle(k, _depth + 1) or holds_pickle(v, _depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(holds_pickle(v, _depth + 1) for v in value)
    return False


def encode(value: Any, *, where: str = "value", pickled: bool = False, _depth: int = 0) -> Any:
    """Return the typed-JSON form of ``value``; raise EncodingError naming ``where``.

    ``pickled``: keep bytes that look pickled (``is_pickle``) as bytes rather than refuse them:
    the caller's explicit choice (the DCP writer's ``allow_pickled_bytes``); they are stored,
    never unpickled by shardfmt."""
    if _depth > MAX_DEPTH:
        raise EncodingError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    d = _depth + 2
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int) and not isinstance(value, np.integer):
        if _I64_MIN <= value <= _I64_MAX:
            return int(value)
        try:
            text = str(int(value))
        except ValueError:  # Python's own limit on int -> str
            text = ""
        if not text or len(text) > 4300:
            raise EncodingError(f"{where}: an integer of more than 4300 characters (sign included) "
                                "cannot be stored")
        return {"$int": text}
    if isinstance(value, float) and not isinstance(value, np.floating):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, list):
        return [encode(v, where=f"{where}[{i}]", pickled=pickled, _depth=d - 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, where=f"{where}[{i}]", pickled=pickled, _depth=d) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, where=f"{where}.{k}", pickled=pickled, _depth=d - 1) for k, v in value.items()}
        return {
            "$dict": [
                [encode(k, where=f"{where} (key {k!r})", pickled=pickled, _depth=d + 1),
                 encode(v, where=f"{where}[{k!r}]", pickled=pickled, _depth=d + 1)]
                for k, v in value.items()
            ]
        }
    if isinstance(value, (bytes, bytearray)):
        if is_pickle(value) and not pickled:
            raise EncodingError(f"{where}: holds pickled bytes; shardfmt never "
                                "writes a pickle, which would run code when read back: return the state as "
                                "tensors and plain values (dicts, lists, numbers, strings) instead")
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NP_KINDS:
            raise EncodingError(f"{where}: numpy array of dtype {value.dtype} cannot be stored")
        arr = np.asarray(value, order="C").astype(value.dtype.newbyteorder("<"), copy=False)  # keeps 0-d
        return {
            "$ndarray": {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "data": base64.b64encode(arr.tobytes()).decode("ascii"),
            }
        }
    if isinstance(value, np.generic):
        if value.dtype.kind not in _NP_KINDS:
            raise EncodingError(f"{where}: numpy scalar of dtype {value.dtype} cannot be stored")
        arr = np.asarray(value).astype(value.dtype.newbyteorder("<"))
        return {
            "$npscalar": {
                "dtype": arr.dtype.str,
                "data": base64.b64encode(arr.tobytes()).decode("ascii"),
            }
        }
    raise EncodingError(
        f"{where}: cannot store a value of type {type(value).__module__}.{type(value).__qualname__} "
        "(shardfmt stores tensors and typed JSON only, never pickle)"
    )


def decode_stored(obj: Any, *, where: str, source: str) -> Any:
    """``decode`` a value read from checkpoint ``source``: one that does not decode is a fault of
    the checkpoint (``ManifestError``), never of the caller's state."""
    try:
        return decode(obj, where=where)
    except EncodingError as e:
        raise ManifestError(f"{source}: {e}") from None


def decode(data: Any, *, where: str = "value") -> Any:
    """Return the Python value of typed JSON ``data``; raise EncodingError if malformed."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, where=f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        raise EncodingError(f"{where}: unexpected JSON value of type {type(data).__name__}")
    if len(data) == 1:
        (tag, body), = data.items()
        if tag.startswith("$"):
            return _decode_tag(tag, body, where)
    for k in data:
        if k.startswith("$"):
            raise EncodingError(f"{where}: plain object with tag-like key {k!r}")
    return {k: decode(v, where=f"{where}.{k}") for k, v in data.items()}


def _b64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise EncodingError(f"{where}: base64 payload must be a string")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise EncodingError(f"{where}: invalid base64 payload ({e})") from None


_NP_DTYPE_RE = re.compile(r"[<>|=]?[biufc][0-9]{1,2}")  # numpy's ``dtype.str`` of a numeric dtype
_MAX_NP_BYTES = 1 << 62  # an array's bytes, empty dims counted as 1 (numpy's own limit is lower)


def _np_dtype(text: Any, where: str) -> np.dtype:
    """The numpy dtype of a stored ``dtype`` string: only the ``dtype.str`` form of a bool, integer,
    float or complex dtype (``<f4``, ``|b1``) reaches numpy, which raises on other strings in ways
    of its own (``"(-1,)i4"``: ValueError) and parses sub-array and structured ones."""
    dt = None
    if isinstance(text, str) and _NP_DTYPE_RE.fullmatch(text):
        try:
            dt = np.dtype(text)
        except (TypeError, ValueError):  # e.g. "<f16" where the platform has no float128
            dt = None
    if dt is not None and dt.str[1:] != text.lstrip("<>|="):  # "i04", "b01": numpy reads them, writes "<i4"
        dt = None
    if dt is None or dt.kind not in _NP_KINDS or dt.subdtype is not None:
        raise EncodingError(f"{where}: unsupported numpy dtype {str(text)[:40]!r}")
    return dt


def _np_shape(shape: Any, itemsize: int, where: str) -> list[int]:
    """A stored ``$ndarray`` shape: at most 64 dims, each in [0, 2^48), and an array numpy can
    describe even when it is empty (``[0, 2^47, 2^47]`` holds no bytes but numpy refuses it)."""
    if not isinstance(shape, list) or len(shape) > 64 or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 48 for s in shape):
        raise EncodingError(f"{where}: bad $ndarray shape {str(shape)[:80]}")
    if math.prod(max(s, 1) for s in shape) * itemsize > _MAX_NP_BYTES:
        raise EncodingError(f"{where}: $ndarray shape {shape} is too large to describe")
    return shape


def _decode_tag(tag: str, body: Any, where: str) -> Any:
    if tag == "$tuple":
        if not isinstance(body, list):
            raise EncodingError(f"{where}: $tuple needs a list")
        return tuple(decode(v, where=f"{where}[{i}]") for i, v in enumerate(body))
    if tag == "$dict":
        if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
            raise EncodingError(f"{where}: $dict needs a list of [key, value] pairs")
        out = {}
        for k, v in body:
            key = decode(k, where=f"{where} (key)")
            try:
                out[key] = decode(v, where=f"{where}[{key!r}]")
            except TypeError:
                raise EncodingError(f"{where}: unhashable dict key {key!r}") from None
        return out
    if tag == "$float":
        if body not in ("nan", "inf", "-inf"):
            raise EncodingError(f"{where}: bad $float {body!r}")
        return float(body)
    if tag == "$int":
        if not isinstance(body, str) or len(body) > 4300 or not re.fullmatch(r"-?(0|[1-9][0-9]*)", body):
            raise EncodingError(f"{where}: bad $int {body!r}")
        return int(body)
    if tag == "$bytes":
        return _b64(body, where)
    if tag == "$ndarray":
        if not isinstance(body, dict) or set(body) != {"dtype", "shape", "data"}:
            raise EncodingError(f"{where}: $ndarray needs dtype, shape and data")
        dt = _np_dtype(body["dtype"], where)
        shape = _np_shape(body["shape"], dt.itemsize, where)
        raw = _b64(body["data"], where)
        if len(raw) != math.prod(shape) * dt.itemsize:
            raise EncodingError(f"{where}: $ndarray data is {len(raw)} bytes, shape {shape} needs "
                                f"{math.prod(shape) * dt.itemsize}")
        arr = np.frombuffer(raw, dtype=dt).reshape(shape)
        return arr.astype(dt.newbyteorder("="), copy=True)
    if tag == "$npscalar":
        if not isinstance(body, dict) or set(body) != {"dtype", "data"}:
            raise EncodingError(f"{where}: $npscalar needs dtype and data")
        dt = _np_dtype(body["dtype"], where)
        raw = _b64(body["data"], where)
        if len(raw) != dt.itemsize:
            raise EncodingError(f"{where}: $npscalar data has {len(raw)} bytes, expected {dt.itemsize}")
        return np.frombuffer(raw, dtype=dt)[0].astype(dt.newbyteorder("="))
    raise EncodingError(f"{where}: unknown tag {tag!r}")
