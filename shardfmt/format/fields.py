"""Field parsers shared by every version's reader: each checks one JSON field and raises a
``ManifestError`` naming its path (``tensors['w'].shards[3].offsets``). Large documents come
as ``jsonscan.Lazy`` members, walked once."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from shardfmt.errors import ManifestError, StateDictError
from shardfmt.format import hashing
from shardfmt.format.jsonscan import Lazy
from shardfmt.format.manifest import (
    MAX_DIM,
    MAX_NDIM,
    MAX_STEP,
    Placement,
    TensorRecord,
    view_reach,
)

FILE_RE = re.compile(r"^data/[A-Za-z0-9_][A-Za-z0-9._-]{0,200}\.safetensors$")
MESH_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
RANK_KEY_RE = re.compile(r"0|[1-9][0-9]{0,7}")


def fail(where: str, msg: str) -> ManifestError:
    return ManifestError(f"manifest {where}: {msg}")


def check_step(step: Any) -> None:
    """Refuse a step the manifest cannot record (None, or an int in [0, 2^62]) before any I/O."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP):
        raise StateDictError(f"step must be None or an integer in [0, 2^62], got {step!r}")


def int_field(v: Any, where: str, *, lo: int = 0, hi: int = MAX_DIM) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise fail(where, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def str_field(v: Any, where: str, *, max_len: int = 4096) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise fail(where, f"expected a string of at most {max_len} characters, got {type(v).__name__}")
    return v


def obj_field(v: Any, where: str) -> dict:
    """A map (files, tensors, ...): parsed, or Lazy (large: walked once with ``items()``)."""
    if not (isinstance(v, dict) or isinstance(v, Lazy) and v.kind == "object"):
        raise fail(where, f"expected an object, got {type_name(v)}")
    return v


def record_fields(v: Any, where: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    """A record's fields as a dict. A Lazy (large) record is walked once: a field given twice is
    refused (the earlier one would go unparsed) and so is an unknown one, as soon as it is met."""
    if isinstance(v, Lazy) and v.kind == "object":
        out: dict = {}
        for k, x in v.items():
            if k in out:
                raise fail(where, f"field {k!r} given twice")
            if k not in required and k not in optional:
                raise fail(where, f"unknown field(s) [{k!r}]")
            out[k] = x
        v = out
    check_keys(obj_field(v, where), where, required, optional)
    return v


def list_field(v: Any, where: str, *, max_len: int = 1 << 31) -> list:
    """A list: parsed, or Lazy (large: iterated once); a short one (a shape, a byte range) is
    always a plain list, whitespace-padded past one piece or not."""
    if not (isinstance(v, list) or isinstance(v, Lazy) and v.kind == "array"):
        raise fail(where, f"expected a list, got {type_name(v)}")
    if len(v) > max_len:
        raise fail(where, f"a list of {len(v)} entries, at most {max_len} allowed")
    return list(v) if isinstance(v, Lazy) and max_len <= MAX_NDIM else v


def type_name(v: Any) -> str:
    return ("object" if v.kind == "object" else "list") if isinstance(v, Lazy) else type(v).__name__


def check_keys(obj: dict, where: str, required: set[str], optional: set[str] = frozenset()) -> None:
    missing = required - obj.keys()
    if missing:
        raise fail(where, f"missing field(s) {sorted(missing)}")
    extra = obj.keys() - required - optional
    if extra:
        raise fail(where, f"unknown field(s) {sorted(extra)[:5]}{' ...' if len(extra) > 5 else ''}")


def digest_field(v: Any, where: str) -> str:
    try:
        hashing.parse_digest(v)
    except ValueError as e:
        raise fail(where, str(e)) from None
    return v


def dims_field(v: Any, where: str) -> tuple[int, ...]:
    lst = list_field(v, where, max_len=MAX_NDIM)
    return tuple(int_field(x, f"{where}[{i}]") for i, x in enumerate(lst))


def parse_file_name(v: Any, where: str) -> str:
    """Accept only ``data/<name>.safetensors``: no absolute paths, no ``..``, no odd bytes."""
    s = str_field(v, where)
    if not FILE_RE.fullmatch(s) or ".." in s:
        raise fail(where, f"file path {s!r} is not of the form data/<name>.safetensors")
    return s


def parse_placement(v: Any, where: str, ndim: int, *, flat: bool = False) -> Placement | None:
    """A placement record; ``flat`` (format v2 and the save's messages) admits ``["flat", o, p]``."""
    if v is None:
        return None
    o = record_fields(v, where, {"mesh_dims", "placements", "stage"})
    dims = tuple(str_field(x, f"{where}.mesh_dims[{i}]", max_len=64)
                 for i, x in enumerate(list_field(o["mesh_dims"], where + ".mesh_dims", max_len=16)))
    places = []
    for i, p in enumerate(list_field(o["placements"], where + ".placements", max_len=16)):
        w = f"{where}.placements[{i}]"
        p = list_field(p, w, max_len=3)
        if p == ["replicate"]:
            places.append(("replicate",))
        elif len(p) == 2 and p[0] == "shard":
            if ndim == 0:
                raise fail(w, "a 0-d tensor cannot be sharded")
            places.append(("shard", int_field(p[1], w + "[1]", hi=ndim - 1)))
        elif len(p) == 3 and p[0] == "strided_shard":
            if ndim == 0:
                raise fail(w, "a 0-d tensor cannot be sharded")
            places.append(("strided_shard", int_field(p[1], w + "[1]", hi=max(ndim - 1, 0)),
                           int_field(p[2], w + "[2]", lo=1, hi=1 << 24)))
        elif flat and len(p) == 3 and p[0] == "flat":
            if ndim == 0:
                raise fail(w, "a 0-d tensor cannot have a flat placement")
            places.append(("flat", int_field(p[1], w + "[1]", hi=MAX_FLAT), int_field(p[2], w + "[2]", lo=1, hi=MAX_FLAT)))
        else:
            raise fail(w, f"unknown placement {p!r}")
    if len(places) != len(dims):
        raise fail(where, f"{len(dims)} mesh dims but {len(places)} placements")
    stage = None if o["stage"] is None else int_field(o["stage"], where + ".stage", hi=1 << 20)
    return Placement(mesh_dims=dims, placements=tuple(places), stage=stage)


MAX_FLAT = 1 << 62  # a flat placement's offset and part, in elements


def step_field(v: Any) -> int | None:
    return None if v is None else int_field(v, "step", hi=MAX_STEP)


def common_fields(o: dict) -> tuple[int, dict[str, str]]:
    """The hash algorithm (checked), chunk size and writer versions of a manifest."""
    if o["hash_algorithm"] != hashing.ALGORITHM:
        raise fail("hash_algorithm", f"unsupported {o['hash_algorithm']!r}")
    chunk_size = int_field(o["chunk_size"], "chunk_size", lo=4096, hi=1 << 30)
    writer = {k: str_field(v, f"writer.{k}", max_len=256) for k, v in obj_field(o["writer"], "writer").items()}
    return chunk_size, writer


def check_links(tensors: Mapping[str, TensorRecord], storages: Mapping[str, TensorRecord]) -> None:
    """Aliases name a stored tensor of their dtype and shape; views a 1-D storage of their
    dtype, within its end; storages are 1-D and stored (spec section 4.3, 4.5)."""
    for name, rec in tensors.items():
        if rec.alias_of is not None:
            target = tensors.get(rec.alias_of)
            if target is None or target.alias_of is not None:
                raise fail(f"tensors[{name!r}].alias_of", f"{rec.alias_of!r} is not a stored tensor")
            if (target.dtype, target.shape) != (rec.dtype, rec.shape):
                raise fail(f"tensors[{name!r}]", "alias dtype/shape differ from its target")
        if rec.view is not None:
            base = storages.get(rec.view.base)
            if base is None:
                raise fail(f"tensors[{name!r}].view.base", f"{rec.view.base!r} is not in storages")
            if base.dtype != rec.dtype or len(base.shape) != 1:
                raise fail(f"tensors[{name!r}].view", "view must share its storage's dtype; storages are 1-D")
            extent = rec.view.storage_offset + view_reach(rec.shape, rec.view.stride)
            if math.prod(rec.shape) and extent > base.shape[0]:
                raise fail(f"tensors[{name!r}].view", f"reaches element {extent - 1} of a {base.shape[0]}-element storage")
    for name, rec in storages.items():
        if not rec.stored or len(rec.shape) != 1:
            raise fail(f"storages[{name!r}]", "a storage must be a 1-D tensor stored in shards")


def check_names(tensors: Mapping, storages: Mapping, values: Mapping) -> None:
    """A name is used in at most one of tensors, storages and values (spec section 4)."""
    clash = (tensors.keys() & storages.keys()) | (tensors.keys() & values.keys()) | (storages.keys() & values.keys())
    if clash:
        raise fail("tensors/storages/values", f"names used twice: {sorted(clash)[:5]}")


def parse_mesh(v: Any, where: str, world_size: int) -> tuple[tuple[str, int], ...]:
    """``topology.mesh``: named dims, outermost first, multiplying to the world size (section 4.1)."""
    mesh = []
    for i, d in enumerate(list_field(v, where + ".mesh", max_len=16)):
        do = record_fields(d, f"{where}.mesh[{i}]", {"name", "size"})
        name = str_field(do["name"], f"{where}.mesh[{i}].name", max_len=64)
        if not MESH_NAME_RE.fullmatch(name):
            raise fail(f"{where}.mesh[{i}].name", f"bad mesh dim name {name!r}")
        mesh.append((name, int_field(do["size"], f"{where}.mesh[{i}].size", lo=1, hi=1 << 24)))
    if mesh and math.prod(s for _, s in mesh) != world_size:
        raise fail(where, f"mesh {mesh} does not multiply to world_size {world_size}")
    if len({n for n, _ in mesh}) != len(mesh):
        raise fail(where + ".mesh", "duplicate mesh dim names")
    return tuple(mesh)
