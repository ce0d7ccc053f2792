"""Hugging Face safetensors layout <-> shardfmt checkpoints, streaming in bounded memory.

``export_hf(src, dst)`` writes the consolidated layout ``transformers``' ``from_pretrained``
loads: ``model.safetensors`` when everything fits in one shard (as ``save_pretrained``
does), else ``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json``
(``weight_map``, ``metadata.total_size``), and ``config.json`` — given, or taken from the
checkpoint's ``metadata["hf_config"]`` (``metadata["user"]["hf_config"]`` for a Checkpointer
save). Names are kept unless mapped: ``only`` selects a subtree and strips its prefix
(``only="model"`` turns ``model.model.layers.0...`` into ``model.layers.0...``), then
``strip_prefix`` and ``add_prefix`` apply. Without ``only``, the top-level ``optim`` and
``optimizer`` subtrees are left out. Tied weights: an alias is written as its own copy
(plain safetensors has no aliasing) except the output embedding ``lm_head.weight`` when the
config's ``tie_word_embeddings`` is true — then it is omitted if it is an alias of, or equal
to, the exported input embedding (transformers ties it again on load), and export fails if
it differs. Views of a shared storage are written materialised.

``import_hf(src, dst)`` reads an HF directory (single file or indexed) as plain safetensors
(no hashes to verify: the bytes are taken as they are) and writes a shardfmt checkpoint of
world size 1, or laid out on ``mesh`` (placements from ``rules``); its ``config.json`` goes
to ``metadata["hf_config"]``, and with ``tie_word_embeddings`` the missing ``lm_head.weight``
comes back as an alias of the input embedding, so ``model.state_dict()`` loads strictly.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from reshard.convert import (
    out_dtype,
    parse_dtype,
    parse_mesh,
    refuse_overlap,
    stored_records,
    write_checkpoint,
)
from reshard.stream import (
    DEFAULT_BUDGET,
    Buffers,
    Part,
    Piece,
    Progress,
    Source,
    Strided,
    Window,
    fill_window,
    fit_uploads,
    memory_plan,
    parse_size,
    plan_windows,
    run_windows,
    verify_headers,
    window_capacity,
)
from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    MissingKeyError,
    ShardfmtError,
    StateDictError,
)
from shardfmt.format import jsonvalue
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.hashing import digest_bytes
from shardfmt.format.manifest import FileRecord, Manifest, ShardRecord, TensorRecord, Topology
from shardfmt.format.safetensors import PREFIX_BYTES, decode_header, encode_header, header_length
from shardfmt.io.registry import get_storage
from shardfmt.io.storage import Storage
from shardfmt.layout.geometry import Box, box_spans
from shardfmt.layout.rules import Rules, load_rules, plan_layouts
from shardfmt.layout.topology import Mesh
from shardfmt.loading.reader import open_checkpoint
from shardfmt.saving.writer import FileStream

HF_CONFIG_KEY = "hf_config"  # manifest metadata key holding a transformers config.json (spec section 8.1)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
OPTIMIZER_ROOTS = ("optim", "optimizer")
OUTPUT_EMBEDDING = "lm_head.weight"
_INPUT_EMBEDDING_RE = re.compile(r"(^|\.)(embed_tokens|wte|word_embeddings|embed_in|tok_embeddings)\.weight$")
_TORCH_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float64: "float64"}


class HFError(ShardfmtError):
    """An HF directory is malformed, or an export cannot be made as asked."""


class ConfigError(HFError, ValueError):
    """The config file given to export (``config=``, ``--config``) cannot be read or is not a
    JSON object: a bad argument."""


def shard_name(k: int, n: int) -> str:
    return SINGLE_NAME if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ----------------------------------------------------------------------------- export


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportReport:
    """What an export wrote and left out."""

    path: str
    files: tuple[str, ...]
    tensors: int
    total_size: int
    omitted: tuple[tuple[str, str], ...]
    excluded: int
    config_written: bool
    bytes_read: int
    seconds: float
    memory_budget: int

    def to_json(self) -> dict:
        return {"path": self.path, "files": list(self.files), "tensors": self.tensors, "total_size": self.total_size,
                "omitted": [list(x) for x in self.omitted], "excluded": self.excluded,
                "config_written": self.config_written, "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3), "memory_budget": self.memory_budget}


def config_from_metadata(metadata: Any) -> dict | None:
    """The transformers config saved in a checkpoint's metadata, if any."""
    if isinstance(metadata, dict):
        cfg = metadata.get(HF_CONFIG_KEY)
        if isinstance(cfg, dict):
            return cfg
        user = metadata.get("user")
        if isinstance(user, dict) and isinstance(user.get(HF_CONFIG_KEY), dict):
            return user[HF_CONFIG_KEY]
    return None


def select_names(names, *, only: str | None, strip_prefix: str | None,
                 add_prefix: str | None) -> tuple[dict[str, str], int]:
    """Map checkpoint names to exported names; return ({exported: checkpoint name}, excluded)."""
    out: dict[str, str] = {}
    excluded = 0
    for name in sorted(names):
        new = name
        if only is not None:
            root = only.rstrip(".")
            if not new.startswith(root + "."):
                excluded += 1
                continue
            new = new[len(root) + 1:]
        elif new.split(".", 1)[0] in OPTIMIZER_ROOTS:
            excluded += 1
            continue
        if strip_prefix and new.startswith(strip_prefix):
            new = new[len(strip_prefix):]
        if add_prefix:
            new = add_prefix + new
        if not new or new == "__metadata__":
            raise HFError(f"tensor {name!r} maps to the name {new!r}, which safetensors cannot hold")
        if new in out:
            raise HFError(f"tensors {out[new]!r} and {name!r} both map to {new!r}")
        out[new] = name
    return out, excluded


def _read_config(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    try:
        with open(config, "rb") as f:
            obj = orjson.loads(f.read())
    except OSError as e:
        raise ConfigError(f"{config}: cannot read the config ({e.strerror or e})") from None
    except orjson.JSONDecodeError as e:
        raise ConfigError(f"{config}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{config}: a config.json must be a JSON object")
    return obj


def export_hf(
    src: str,
    dst: str,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | torch.dtype | None = None,
    only: str | None = None,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    config: str | Mapping | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    verify: bool = True,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: bool = False,
) -> ExportReport:
    """Export the checkpoint at ``src`` to the Hugging Face layout in directory ``dst``.

    See the module docstring for names, tied weights and the config. Files are cut greedily
    at ``max_shard_size`` (``"5GB"`` = 5*10^9 bytes, as transformers counts; a larger tensor
    gets a file of its own), tensors in natural name order. ``dtype`` casts floating
    tensors (and sets the config's ``dtype``). At most ``memory_budget`` bytes of tensor data
    are held at once. The directory appears complete or not at all (staged, then renamed,
    on local disk).
    """
    t0 = time.perf_counter()
    max_bytes = parse_size(max_shard_size, what="max shard size")
    budget = parse_size(memory_budget, what="memory budget")
    cast = parse_dtype(dtype)
    given_cfg = _read_config(config) if config is not None else None
    refuse_overlap(*get_storage(src, storage_options), dst, storage_options)
    ckpt = open_checkpoint(src, storage_options=storage_options)
    before = ckpt.storage.stats.snapshot()
    m = ckpt.manifest
    dst_storage, dst_path = get_storage(dst, storage_options)
    _check_destination(dst_storage, dst_path, overwrite)

    cfg = given_cfg if config is not None else config_from_metadata(jsonvalue.decode(m.metadata, where="metadata"))
    names, excluded = select_names(m.tensors, only=only, strip_prefix=strip_prefix, add_prefix=add_prefix)
    if not names:
        tops = sorted({n.split(".", 1)[0] for n in m.tensors})
        raise MissingKeyError(f"{ckpt.path}: no tensors to export"
                              + (f" under {only!r}" if only else "") + f" (top-level names: {tops[:10]})")

    source = Source(storage=ckpt.storage, path=ckpt.path, manifest=m, verify=verify)
    mem = memory_plan(fit_uploads(dst_storage, budget), chunk_size=m.chunk_size, verify=verify,
                      workers=min(4, ckpt.storage.read_concurrency))
    buffers = None
    omitted: list[tuple[str, str]] = []
    tie = bool(cfg and cfg.get("tie_word_embeddings") is True)
    if tie and OUTPUT_EMBEDDING in names:
        buffers = Buffers(mem, need=mem.window)
        why = _tied_output(source, names, buffers)
        if why is not None:
            omitted.append((OUTPUT_EMBEDDING, why))
            del names[OUTPUT_EMBEDDING]

    # one piece per exported tensor: (name, src record, box, dtype, strided)
    items = []
    for new in sorted(names, key=_natural):
        name = names[new]
        rec = m.tensors[name]
        dt = out_dtype(rec.dtype, cast)
        if rec.view is not None:
            v = rec.view
            n = 1 + sum((k - 1) * s for k, s in zip(rec.shape, v.stride)) if all(rec.shape) else 0
            box = Box((v.storage_offset,), (n,)) if n else Box((0,), (0,))
            items.append((new, v.base, box, dt, Strided(tuple(rec.shape), tuple(v.stride), 0), tuple(rec.shape)))
        else:
            base, brec = m.resolve(name)
            items.append((new, base, Box.full(brec.shape), dt, None, tuple(rec.shape)))

    # files: greedy, in natural name order, as transformers does
    groups: list[list[int]] = [[]]
    size = 0
    for i, (_, _, _, dt, _, shape) in enumerate(items):
        n = _numel(shape) * dt.itemsize
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    nfiles = len(groups)
    pieces: list[Piece] = []
    headers = []
    weight_map: dict[str, str] = {}
    for f, g in enumerate(groups):
        order = sorted(g, key=lambda i: (-items[i][3].itemsize, items[i][0]))
        headers.append(encode_header([(items[i][0], dtype_code(items[i][3], what=items[i][0]), items[i][5])
                                      for i in order], metadata={"format": "pt"}))
        for i in order:
            new, base, box, dt, strided, _ = items[i]
            pieces.append(Piece(file=f, src=base, box=box, dtype=dt, strided=strided))
            weight_map[new] = shard_name(f, nfiles)
    shapes = {p.src: m.tensor(p.src).shape for p in pieces}
    capacity = window_capacity(mem, sum(p.buffer_bytes for p in pieces))
    if any(p.strided is not None and p.buffer_bytes > capacity for p in pieces):
        capacity = mem.window  # a materialised view is held whole: use the whole slot
    windows = plan_windows(pieces, [[i] for i in range(len(pieces))], shapes, capacity=capacity,
                           names={i: p.src for i, p in enumerate(pieces)})
    verify_headers(source, pieces)
    if buffers is None:
        buffers = Buffers(mem, need=max((w.nbytes for w in windows), default=0))

    out_cfg = dict(cfg) if cfg is not None else None
    if out_cfg is not None and cast is not None:
        out_cfg["dtype"] = _TORCH_NAMES[cast]
        if "torch_dtype" in out_cfg:
            out_cfg["torch_dtype"] = _TORCH_NAMES[cast]
    total = sum(h.file_size - len(h.data) for h in headers)
    staging = _stage(dst_storage, dst_path)
    bar = Progress(total, "export-hf", progress)
    sinks = _LazyFiles(dst_storage, staging, [shard_name(f, nfiles) for f in range(nfiles)], headers)
    try:
        run_windows(source, pieces, windows, sinks, buffers, progress=bar)
        sinks.close_all()
        if nfiles > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            dst_storage.write_bytes(dst_storage.join(staging, INDEX_NAME),
                                    (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        if out_cfg is not None:
            dst_storage.write_bytes(dst_storage.join(staging, CONFIG_NAME),
                                    (json.dumps(out_cfg, indent=2, sort_keys=True) + "\n").encode())
        _publish(dst_storage, staging, dst_path, overwrite)
    except BaseException:
        sinks.abort_all()
        if staging != dst_path or not overwrite:
            _remove_quietly(dst_storage, staging)
        raise
    finally:
        bar.close()
    return ExportReport(path=dst, files=tuple(shard_name(f, nfiles) for f in range(nfiles)), tensors=len(items),
                        total_size=total, omitted=tuple(omitted), excluded=excluded,
                        config_written=out_cfg is not None,
                        bytes_read=ckpt.storage.stats.snapshot()["bytes_read"] - before["bytes_read"],
                        seconds=time.perf_counter() - t0,
                        memory_budget=budget)


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _tied_output(source: Source, names: dict[str, str], buffers: Buffers) -> str | None:
    """Why ``lm_head.weight`` can be left out under ``tie_word_embeddings`` (None: it cannot).

    Raise when the config says tied but the stored output embedding differs from the input one.
    """
    m = source.manifest
    head = names[OUTPUT_EMBEDDING]
    rec = m.tensors[head]
    head_base, _ = m.resolve(head)
    inputs = [new for new, old in names.items() if _INPUT_EMBEDDING_RE.search(new) and new != OUTPUT_EMBEDDING]
    for new in inputs:
        base, _ = m.resolve(names[new])
        if base == head_base and rec.view is None:
            return f"tied to {new} (an alias in the checkpoint; tie_word_embeddings is true)"
    cands = [new for new in inputs if m.tensors[names[new]].shape == rec.shape
             and m.tensors[names[new]].dtype == rec.dtype]
    if len(cands) != 1 or rec.view is not None or m.tensors[names[cands[0]]].view is not None:
        return None  # no single input embedding to tie to: keep it
    emb = cands[0]
    if equal_records(source, head_base, m.resolve(names[emb])[0], buffers):
        return f"equal to {emb} (tie_word_embeddings is true)"
    raise HFError(f"the config has tie_word_embeddings=true, but {OUTPUT_EMBEDDING} ({head!r}) differs from the "
                  f"input embedding {emb} ({names[emb]!r}); pass a config with tie_word_embeddings=false")


def equal_records(source: Source, a: str, b: str, buffers: Buffers) -> bool:
    """Whether two records of the same shape and dtype hold the same bytes (streamed in runs)."""
    m = source.manifest
    rec = m.tensor(a)
    dt = out_dtype(rec.dtype, None)
    slot = buffers.slots[0]
    cap = max(dt.itemsize, (slot.numel() // 2) // 8 * 8)

    for span in box_spans(rec.shape, Box.full(rec.shape), dt.itemsize, max_span=cap) if _numel(rec.shape) else []:
        n = span.box.numel * dt.itemsize
        pieces = [Piece(file=0, src=a, box=span.box, dtype=dt), Piece(file=1, src=b, box=span.box, dtype=dt)]
        off = -(-n // 8) * 8
        window = Window(parts=(Part(piece=0, box=span.box, offset=0, nbytes=n),
                               Part(piece=1, box=span.box, offset=off, nbytes=n)), nbytes=off + n)
        fill_window(source, pieces, window, slot, buffers)
        if not torch.equal(slot[:n], slot[off:off + n]):
            return False
    return True


class _LazyFiles(Mapping):
    """The export's files, opened when their first byte arrives and closed after their last
    (files are written one after the other: at most two are open)."""

    def __init__(self, storage: Storage, directory: str, names: list[str], headers: list) -> None:
        self._storage = storage
        self._dir = directory
        self._names = names
        self._headers = headers
        self._open: dict[int, FileStream] = {}
        self._closed: set[int] = set()

    def __getitem__(self, f: int) -> FileStream:
        s = self._open.get(f)
        if s is None:
            if f in self._closed:
                raise HFError(f"internal: {self._names[f]} written after it was closed")
            for g in [g for g in self._open if g < f]:  # files are written in order
                self._open.pop(g).close()
                self._closed.add(g)
            s = self._open[f] = FileStream(self._storage, self._storage.join(self._dir, self._names[f]),
                                           self._headers[f])
        return s

    def __iter__(self):
        return iter(range(len(self._names)))

    def __len__(self) -> int:
        return len(self._names)

    def close_all(self) -> None:
        for f in range(len(self._names)):
            if f not in self._closed:
                self[f].close()
                self._open.pop(f, None)
                self._closed.add(f)

    def abort_all(self) -> None:
        for s in self._open.values():
            s.abort()
        self._open.clear()


def _check_destination(storage: Storage, path: str, overwrite: bool) -> None:
    if storage.exists(path) and not overwrite and (not storage.isdir(path) or storage.listdir(path)):
        raise CheckpointExistsError(f"{path}: already exists (pass overwrite=True / --overwrite to replace it)")


def _stage(storage: Storage, path: str) -> str:
    """Where files are written before they are published (the destination on object stores)."""
    if commit_strategy(storage).in_place:
        if storage.exists(path):
            storage.remove_tree(path)
        storage.makedirs(path)
        return path
    staging = f"{path.rstrip('/')}.tmp-{uuid.uuid4().hex[:16]}"
    storage.makedirs(staging)
    return staging


def _publish(storage: Storage, staging: str, path: str, overwrite: bool) -> None:
    if staging == path:
        return
    storage.sync_dir(staging)
    if storage.exists(path):
        if not overwrite and storage.listdir(path):
            raise CheckpointExistsError(f"{path}: appeared while exporting; refusing to replace it")
        old = f"{path.rstrip('/')}.old-{uuid.uuid4().hex[:16]}"
        storage.rename(path, old)
        storage.rename(staging, path)
        _remove_quietly(storage, old)
    else:
        storage.rename(staging, path)
    storage.sync_dir(posixpath.dirname(path.rstrip("/")) or ".")


def _remove_quietly(storage: Storage, path: str) -> None:
    try:
        storage.remove_tree(path)
    except (OSError, ShardfmtError):
        pass


# ----------------------------------------------------------------------------- import


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportReport:
    """What an import wrote."""

    path: str
    manifest: Manifest
    source_files: tuple[str, ...]
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float
    tied_alias: str | None
    memory_budget: int

    def to_json(self) -> dict:
        return {"path": self.path, "source_files": list(self.source_files), "tensors": self.tensors,
                "world": self.manifest.topology.world_size, "files": len(self.manifest.files),
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "seconds": round(self.seconds, 3), "tied_alias": self.tied_alias, "memory_budget": self.memory_budget}


def hf_files(storage: Storage, path: str) -> tuple[str, list[str], dict[str, str] | None]:
    """Return (directory, safetensors file names, weight_map or None) of an HF model at ``path``
    (a directory with an index or one safetensors file, or a .safetensors file itself)."""
    if path.endswith(".safetensors") and storage.exists(path) and not storage.isdir(path):
        return posixpath.dirname(path) or ".", [posixpath.basename(path)], None
    if not storage.exists(path) or not storage.isdir(path):
        raise CheckpointNotFoundError(f"{path}: no such directory")
    names = sorted(posixpath.basename(n.rstrip("/")) for n in storage.listdir(path))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        indexes = [n for n in indexes if n == INDEX_NAME] or indexes
    if indexes:
        where = storage.join(path, indexes[0])
        try:
            idx = orjson.loads(storage.read_bytes(where, limit=256 << 20))
        except orjson.JSONDecodeError as e:
            raise HFError(f"{where}: not valid JSON ({e})") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise HFError(f"{where}: no 'weight_map' object of tensor name -> file name")
        files = sorted(set(wm.values()))
        for f in files:
            if "/" in f or f in ("", ".", "..") or not storage.exists(storage.join(path, f)):
                raise HFError(f"{where}: weight_map names {f!r}, which is not a file in {path}")
        return path, files, wm
    st = [n for n in names if n.endswith(".safetensors")]
    if len(st) == 1:
        return path, st, None
    if st:
        raise HFError(f"{path}: {len(st)} safetensors files and no *.safetensors.index.json saying which is which")
    if any(n.endswith(".bin") or n.endswith(".pt") or n.endswith(".pth") for n in names):
        raise HFError(f"{path}: only pickled weights (.bin/.pt) here; import-hf reads safetensors only (never pickle)")
    raise HFError(f"{path}: no safetensors weights found")


def hf_manifest(storage: Storage, directory: str, files: list[str], weight_map: dict[str, str] | None) -> Manifest:
    """An in-memory manifest over plain safetensors files: one whole-tensor shard per tensor
    (never written: it has no hashes, so its files are read with verify=False)."""
    tensors: dict[str, TensorRecord] = {}
    recs: dict[str, FileRecord] = {}
    where_of: dict[str, str] = {}
    for fname in files:
        full = storage.join(directory, fname)
        reader = storage.open_reader(full)
        try:
            size = reader.size
            prefix = bytearray(min(PREFIX_BYTES, size))
            reader.readinto(0, [memoryview(prefix)])
            n = header_length(bytes(prefix), source=full, file_size=size)
            body = bytearray(n)
            if n:
                reader.readinto(PREFIX_BYTES, [memoryview(body)])
        finally:
            reader.close()
        raw = bytes(prefix) + bytes(body)
        header = decode_header(raw, source=full, file_size=size)
        recs[fname] = FileRecord(rank=0, size=size, header_size=len(raw), header_digest=digest_bytes(raw),
                                 chunks=(), digest=digest_bytes(b""))
        for key, e in header.entries.items():
            if key in tensors:
                raise HFError(f"{directory}: tensor {key!r} is in both {where_of[key]} and {fname}")
            if weight_map is not None and weight_map.get(key) != fname:
                raise HFError(f"{full}: holds tensor {key!r}, which the index maps to {weight_map.get(key)!r}")
            where_of[key] = fname
            shard = ShardRecord(offsets=(0,) * len(e.shape), lengths=tuple(e.shape), file=fname, key=key,
                                byte_range=(e.start, e.end), digest=digest_bytes(b""))
            tensors[key] = TensorRecord(dtype=e.dtype, shape=tuple(e.shape), shards=(shard,))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise HFError(f"{directory}: the index maps {missing[:5]} to files that do not hold them")
    return Manifest(save_id="hf-import", created_at="", files=recs, tensors=dict(sorted(tensors.items())))


def import_hf(
    src: str,
    dst: str,
    *,
    mesh: str | Mapping[str, int] | Mesh | None = None,
    rules: str | Rules | None = None,
    dtype: str | torch.dtype | None = None,
    memory_budget: int | str = DEFAULT_BUDGET,
    overwrite: bool = False,
    storage_options: dict | None = None,
    progress: bool = False,
) -> ImportReport:
    """Import the HF safetensors model at ``src`` as a shardfmt checkpoint at ``dst``.

    World size 1 by default (one data file); with ``mesh`` each rank's slices go to its own
    file, laid out by ``rules`` (tensors no rule matches are replicated, written once). See
    the module docstring for the config and tied embeddings.
    """
    budget = parse_size(memory_budget, what="memory budget")
    cast = parse_dtype(dtype)
    if rules is not None and mesh is None:
        raise ValueError("rules need a mesh to lay tensors out on (pass mesh=..., --mesh)")
    if isinstance(rules, (str, os.PathLike)):
        rules = load_rules(os.fspath(rules))
    storage, path = get_storage(src, storage_options)
    directory, files, weight_map = hf_files(storage, path)
    refuse_overlap(storage, directory, dst, storage_options)
    m = hf_manifest(storage, directory, files, weight_map)
    cfg = None
    cfg_path = storage.join(directory, CONFIG_NAME)
    if storage.exists(cfg_path):
        try:
            cfg = orjson.loads(storage.read_bytes(cfg_path, limit=64 << 20))
        except orjson.JSONDecodeError as e:
            raise HFError(f"{cfg_path}: not valid JSON ({e})") from None
    aliases: dict[str, str] = {}
    if isinstance(cfg, dict) and cfg.get("tie_word_embeddings") is True and OUTPUT_EMBEDDING not in m.tensors:
        cands = [n for n in m.tensors if _INPUT_EMBEDDING_RE.search(n) and len(m.tensors[n].shape) == 2]
        if len(cands) == 1:
            aliases[OUTPUT_EMBEDDING] = cands[0]
    if mesh is None:
        the_mesh = Mesh((("world", 1),))
        topology = Topology(world_size=1)
    else:
        the_mesh = parse_mesh(mesh)
        topology = Topology(world_size=the_mesh.world_size, mesh=the_mesh.dims)
    layouts, _ = plan_layouts(stored_records(m), the_mesh, rules)
    source = Source(storage=storage, path=directory, manifest=m, verify=False, follow_links=True)
    metadata = {HF_CONFIG_KEY: cfg} if isinstance(cfg, dict) else None
    try:
        jsonvalue.encode(metadata, where="metadata")
    except StateDictError as e:
        raise HFError(f"{cfg_path}: cannot be kept as metadata ({e})") from None
    manifest, stats, _ = write_checkpoint(
        source, dst, mesh=the_mesh, topology=topology, layouts=layouts, cast=cast, memory_budget=budget,
        metadata=metadata, step=None, values={}, aliases=aliases, storage_options=storage_options,
        overwrite=overwrite, progress=progress, record_placements=mesh is not None, desc="import-hf")
    return ImportReport(path=dst, manifest=manifest, source_files=tuple(files), tensors=len(m.tensors),
                        bytes_read=stats.bytes_read, bytes_written=stats.bytes_written, seconds=stats.seconds,
                        tied_alias=aliases.get(OUTPUT_EMBEDDING), memory_budget=budget)


__all__ = ["ConfigError", "ExportReport", "HFError", "HF_CONFIG_KEY", "ImportReport", "export_hf", "import_hf"]
