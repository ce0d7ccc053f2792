"""v2: find exactly the shards a load reads, reading only what describes them.

A v2 root manifest says how each tensor is laid out (a placement, or listed boxes with their
writer ranks) but not where any byte is. ``resolve`` takes the slices one rank loads and:

1. derives the saved boxes each slice overlaps and the rank that wrote each
   (``layout.placed.saved_pieces``; a sweep over listed boxes), in time proportional to them;
2. reads the rank-table parts that cover those ranks, and those ranks' indexes, each checked
   against the digest that vouches for it (root -> part -> index);
3. reads the header of each of their data files (exactly ``header_size`` bytes, checked
   against the index's ``header_digest`` when verifying) and finds each box's key by its
   ``__metadata__["shards"]`` entry, checking dtype, shape, offsets and the tensor's shape;
4. returns the root manifest with those shards and files filled in: what ``plan_load`` and
   the executor take, with each file's hash chunks aligned to its shards (spec section 7).

So the metadata a rank reads and checks follows the slices it loads, not the job's size.
``with_rank_values`` reads the one index that holds a rank's per-rank values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from shardfmt.errors import HeaderError, ManifestError
from shardfmt.format import hashing, refs
from shardfmt.format.manifest import FileRecord, Manifest, ShardRecord, TensorRecord, ValueRecord
from shardfmt.io.documents import (
    DataFile,
    check_bases,
    read_headers,
    read_indexes,
)
from shardfmt.io.store import Storage
from shardfmt.layout.geometry import Box, intersect
from shardfmt.layout.placed import saved_pieces
from shardfmt.layout.topology import layout_from_record
from shardfmt.loading.planner import ShardIndex, TargetSlice

Piece = tuple[int, Box]  # (writer rank, saved box)


def resolve(storage: Storage, path: str, manifest: Manifest, slices: Sequence[TargetSlice], *,
            verify: bool) -> Manifest:
    """Return ``manifest`` with the shards and files ``slices`` read (a v1 manifest as it is)."""
    if manifest.format_version < 2:
        return manifest
    wanted: dict[str, dict[Box, int]] = {}
    for s in slices:
        rec = manifest.tensor(s.fqn)
        if not rec.stored:
            continue  # the planner names the problem
        got = wanted.setdefault(s.fqn, {})
        for rank, box in pieces(manifest, rec, s.box):
            got[box] = rank
    ranks = sorted({r for boxes in wanted.values() for r in boxes.values()})
    indexes = read_indexes(storage, path, manifest, ranks)
    found = read_headers(storage, path, manifest, indexes, verify=verify)
    shards: dict[str, list[ShardRecord]] = {}
    files: dict[str, FileRecord] = {}
    for fqn in sorted(wanted):
        rec = manifest.tensor(fqn)
        for box, rank in sorted(wanted[fqn].items(), key=lambda kv: kv[0].offsets):
            shard, frec = _locate(found, manifest, fqn, rec, box, rank)
            shards.setdefault(fqn, []).append(shard)
            files[shard.file] = frec
    if not verify:  # no digest will catch a base replaced since: its COMMITTED must still be the chain's
        check_bases(storage, path, refs.chain_of(manifest), files)
    return dataclasses.replace(
        manifest, files=dict(sorted(files.items())),
        tensors={f: _with(r, shards.get(f)) for f, r in manifest.tensors.items()},
        storages={f: _with(r, shards.get(f)) for f, r in manifest.storages.items()})


def _with(rec: TensorRecord, shards: list[ShardRecord] | None) -> TensorRecord:
    return rec if shards is None else dataclasses.replace(rec, shards=tuple(shards))


def pieces(manifest: Manifest, rec: TensorRecord, box: Box) -> list[Piece]:
    """The saved boxes of ``rec`` that overlap ``box``, each with the rank that wrote it."""
    if box.is_empty():
        return []
    if rec.placed is not None:
        layout = layout_from_record(rec.placed.placement)
        return [(p.rank, p.box) for p in saved_pieces(rec.shape, layout, manifest.topology.mesh,
                                                        writer=rec.placed.writer, box=box)]
    listed = rec.listed or ()
    if len(listed) == 1:  # one writer held it whole (plain and replicated tensors): no index to build
        (s,) = listed
        saved = Box(s.offsets, s.lengths)
        hit = intersect(saved, box)
        return [] if hit is None or hit.is_empty() else [(s.rank, saved)]
    return [(s.rank, Box(s.offsets, s.lengths)) for s, _ in ShardIndex(listed).overlapping(box)]


def with_rank_values(storage: Storage, path: str, manifest: Manifest, rank: int) -> Manifest:
    """``manifest`` with rank ``rank``'s per-rank values, read from its index (v2; a v1
    manifest, or one without per-rank values, as it is). A rank outside the saved job, or
    one without values, gets none: ``per_rank`` is then empty."""
    indexed = [f for f, v in manifest.values.items() if v.indexed]
    if not indexed:
        return manifest
    index = None
    if 0 <= rank < manifest.topology.world_size:
        index = read_indexes(storage, path, manifest, [rank], required=False).get(rank)
    got: Mapping[str, Any] = {} if index is None else index.values
    values = dict(manifest.values)
    for f in indexed:
        values[f] = ValueRecord(indexed=True, per_rank={rank: got[f]} if f in got else {})
    return dataclasses.replace(manifest, values=values)


def _locate(found: Mapping[int, list[DataFile]], manifest: Manifest, fqn: str, rec: TensorRecord, box: Box,
            rank: int) -> tuple[ShardRecord, FileRecord]:
    """The shard record of the saved ``box`` of ``fqn`` that ``rank`` wrote, and its file's record."""
    holders = [f.name for f in found[rank] if (fqn, box.offsets) in f.by_place]
    if len(holders) > 1:
        raise HeaderError(f"tensor {fqn!r}: rank {rank}'s files {holders} all hold its box at {list(box.offsets)} "
                          "(spec section 4.4)")
    for f in found[rank]:
        key = f.by_place.get((fqn, box.offsets))
        if key is None:
            continue
        e, o = f.header.entries[key], f.origins[key]
        if key not in (fqn, f"{fqn}@{','.join(map(str, box.offsets))}"):
            raise HeaderError(f"{f.name}: tensor {fqn!r}: key {key!r} is not one this tensor's shard may have")
        if (e.dtype, tuple(e.shape), tuple(o.global_shape)) != (rec.dtype, box.lengths, rec.shape):
            raise HeaderError(f"{f.name}: tensor {fqn!r} at {list(box.offsets)}: the file holds {e.dtype} "
                              f"{list(e.shape)} of a {list(o.global_shape)} tensor, the manifest says {rec.dtype} "
                              f"{list(box.lengths)} of {list(rec.shape)}")
        span = f.grid.span(e.start, e.end)
        shard = ShardRecord(offsets=box.offsets, lengths=box.lengths, file=f.name, key=key,
                            byte_range=(e.start, e.end), digest=hashing.combine(f.digests()[span.start:span.stop]))
        return shard, f.file_record()
    raise ManifestError(f"tensor {fqn!r}: rank {rank} should have written its box {list(box.offsets)}+"
                        f"{list(box.lengths)}, but none of its files ({[f.name for f in found[rank]]}) holds it")


# ----------------------------------------------------------------------------- the whole checkpoint


def expand(storage: Storage, path: str, manifest: Manifest, *, verify: bool = True) -> Manifest:
    """Return a v2 ``manifest`` with every file, every shard and every rank's per-rank values
    filled in (a v1 manifest as it is): what offline tools that walk a whole checkpoint (copy,
    convert, export, list) take. It reads every rank index and every header, so its cost grows
    with the job; a load reads only its part (``resolve``)."""
    if manifest.format_version < 2:
        return manifest
    ranks = [r for part in manifest.ranks for r in range(part.first, part.end)]
    indexes = read_indexes(storage, path, manifest, ranks, required=False)
    found = read_headers(storage, path, manifest, indexes, verify=verify)
    shards: dict[str, list[ShardRecord]] = {}
    files: dict[str, FileRecord] = {}
    for rank in sorted(found):
        for f in found[rank]:
            files[f.name] = f.file_record()
            for key, o in sorted(f.origins.items()):
                rec = manifest.tensors.get(o.fqn) or manifest.storages.get(o.fqn)
                if rec is None or not rec.stored:
                    raise ManifestError(f"{f.name}: entry {key!r} belongs to {o.fqn!r}, which the manifest does not store")
                box = Box(tuple(o.offsets), tuple(f.header.entries[key].shape))
                shard, _ = _locate(found, manifest, o.fqn, rec, box, rank)
                shards.setdefault(o.fqn, []).append(shard)
    values = dict(manifest.values)
    for name, v in manifest.values.items():
        if v.indexed:
            values[name] = ValueRecord(indexed=True, per_rank={r: idx.values[name] for r, idx in sorted(indexes.items())
                                                                if name in idx.values})
    for got in shards.values():
        got.sort(key=lambda s: (s.offsets, s.file))  # the v1 writer's order
    return dataclasses.replace(
        manifest, files=dict(sorted(files.items())), values=values,
        tensors={f: _with(r, shards.get(f, [])) if r.stored else r for f, r in manifest.tensors.items()},
        storages={f: _with(r, shards.get(f, [])) for f, r in manifest.storages.items()})


def file_sizes(storage: Storage, path: str, manifest: Manifest) -> dict[str, int]:
    """Every data file's name and size, from the manifest (v1) or the rank indexes (v2: no
    header is read)."""
    if manifest.format_version < 2:
        return {name: f.size for name, f in manifest.files.items()}
    ranks = [r for part in manifest.ranks for r in range(part.first, part.end)]
    indexes = read_indexes(storage, path, manifest, ranks, required=False)
    return {name: f.size for idx in indexes.values() for name, f in sorted(idx.files.items())}
