"""The Hugging Face safetensors layout -> a shardfmt checkpoint, streaming in bounded memory.

``import_hf(src, dst)`` reads an HF directory (single file or indexed) as plain safetensors
(no hashes to verify: the bytes are taken as they are) and writes a shardfmt checkpoint of
world size 1, or laid out on ``mesh`` (placements from ``rules``); its ``config.json`` goes
to ``metadata["hf_config"]``, and with ``tie_word_embeddings`` the missing ``lm_head.weight``
comes back as an alias of the input embedding, so ``model.state_dict()`` loads strictly.

Protocol: 1) find the safetensors files (``hf_files``: the index's ``weight_map``, or the one
file); 2) read their headers into an in-memory manifest (``hf_manifest``: one whole-tensor
shard per tensor, no hashes); 3) read config.json; 4) lay the tensors out on the mesh and
write them with convert's engine (``reshard.convert.write_checkpoint``).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from reshard._shardfmt import (
    PREFIX_BYTES,
    FileRecord,
    Manifest,
    Mesh,
    Rules,
    ShardRecord,
    Storage,
    TensorRecord,
    Topology,
    decode_header,
    digest_bytes,
    get_storage,
    header_length,
    jsonvalue,
    load_rules,
    plan_layouts,
)
from reshard.convert import stored_records, write_checkpoint
from reshard.errors import HFError
from reshard.hf_layout import (
    CONFIG_NAME,
    HF_CONFIG_KEY,
    INDEX_NAME,
    INPUT_EMBEDDING_RE,
    OUTPUT_EMBEDDING,
)
from reshard.overlap import refuse_overlap
from reshard.parse import parse_dtype, parse_mesh, parse_size
from reshard.stream.memory import DEFAULT_BUDGET
from reshard.stream.run import Source
from shardfmt.errors import CheckpointNotFoundError, StateDictError


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
    cfg_path = storage.join(directory, CONFIG_NAME)
    cfg = _read_config(storage, cfg_path)
    aliases = _tied_aliases(m, cfg)
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


def _read_config(storage: Storage, cfg_path: str) -> Any:
    """The model's config.json as parsed JSON (None when there is none)."""
    if not storage.exists(cfg_path):
        return None
    try:
        return orjson.loads(storage.read_bytes(cfg_path, limit=64 << 20))
    except orjson.JSONDecodeError as e:
        raise HFError(f"{cfg_path}: not valid JSON ({e})") from None


def _tied_aliases(m: Manifest, cfg: Any) -> dict[str, str]:
    """``{"lm_head.weight": <the input embedding>}`` when the config ties them and the model
    left the output embedding out (as ``save_pretrained`` does); else nothing."""
    if isinstance(cfg, dict) and cfg.get("tie_word_embeddings") is True and OUTPUT_EMBEDDING not in m.tensors:
        cands = [n for n in m.tensors if INPUT_EMBEDDING_RE.search(n) and len(m.tensors[n].shape) == 2]
        if len(cands) == 1:
            return {OUTPUT_EMBEDDING: cands[0]}
    return {}


__all__ = ["ImportReport", "hf_files", "hf_manifest", "import_hf"]
