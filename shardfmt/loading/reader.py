"""Opening a committed checkpoint: COMMITTED first, then the manifest it vouches for.

A checkpoint exists only if ``COMMITTED`` is present and the manifest's digest matches the
one it records; anything else is refused before a single data byte is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from shardfmt.commit.names import parse_step_dir
from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import (
    CheckpointNotFoundError,
    CommitError,
    HeaderError,
    IntegrityError,
    ShardfmtError,
    SpecialFileError,
    StorageError,
)
from shardfmt.format import hashing, refs
from shardfmt.format.manifest import (
    COMMITTED_NAME,
    DATA_DIR,
    MANIFEST_NAME,
    MAX_COMMITTED_BYTES,
    MAX_MANIFEST_BYTES,
    CommitRecord,
    Manifest,
    ShardRecord,
)
from shardfmt.format.nodepart import NODE_PART_NAME
from shardfmt.format.parse import parse_commit, parse_manifest
from shardfmt.format.safetensors import decode_origins
from shardfmt.io.documents import read_header
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.loading.resolve import expand


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A committed checkpoint, opened: where it is and what its manifest says."""

    storage: Storage
    path: str
    manifest: Manifest
    commit: CommitRecord


def resolve_path(storage: Storage, path: str) -> str:
    """Return ``path``, or the committed ``<path>.old-*`` an interrupted overwrite left."""
    return commit_strategy(storage).resolve(path)


def _read_member(storage: Storage, path: str, name: str, *, limit: int) -> bytes:
    """Read the file ``name`` of the checkpoint at ``path``: a regular file reached through no
    link (spec section 2); anything else makes the checkpoint invalid (SpecialFileError, not a
    storage failure)."""
    full = storage.join(path, name)
    try:
        return storage.read_bytes(full, limit=limit, within=path)
    except (CheckpointNotFoundError, SpecialFileError):
        raise
    except StorageError:
        if storage.isdir(full):  # a store that does not tell a directory apart (fsspec)
            raise SpecialFileError(f"{storage.url(full)}: is a directory, not a regular file") from None
        raise


def read_commit(storage: Storage, path: str) -> CommitRecord:
    marker = storage.join(path, COMMITTED_NAME)
    try:
        raw = _read_member(storage, path, COMMITTED_NAME, limit=MAX_COMMITTED_BYTES)
    except CheckpointNotFoundError:
        if commit_strategy(storage).in_place and not storage.exists(path):
            raise CheckpointNotFoundError(f"{storage.url(path)}: no checkpoint there") from None
        raise not_a_checkpoint(storage, path) from None
    return parse_commit(raw, source=storage.url(marker))


def not_a_checkpoint(storage: Storage, path: str) -> ShardfmtError:
    """The error for the directory ``path``, which holds no COMMITTED, saying what it is: a save
    not (yet) committed (CommitError), or a Checkpointer root, a Hugging Face model folder or
    something else, each a path that names no checkpoint (CheckpointNotFoundError)."""
    url = storage.url(path)
    names = storage.listdir(path)
    if NODE_PART_NAME in names:
        return CheckpointNotFoundError(
            f"{url}: is one node's part of a checkpoint saved on the node-local tier (the other nodes' files are "
            "on their own disks): restore it through the Checkpointer, or read the copy on its shared tier")
    if MANIFEST_NAME in names or DATA_DIR in names:
        return CommitError(f"{url}: not committed (no {COMMITTED_NAME} marker: an interrupted or in-progress save)")
    steps = sorted(n for n in names if parse_step_dir(n) is not None)
    if steps:
        held = ", ".join(steps[-3:]) + (f" ({len(steps)} in all)" if len(steps) > 3 else "")
        return CheckpointNotFoundError(f"{url}: is a checkpoint root holding {held}: pass one of them, e.g. "
                                       f"{storage.url(storage.join(path, steps[-1]))}")
    if any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names):
        return CheckpointNotFoundError(f"{url}: is a Hugging Face model folder, not a shardfmt checkpoint; "
                                       "`reshard import-hf` converts it")
    return CheckpointNotFoundError(f"{url}: not a shardfmt checkpoint: no {COMMITTED_NAME} or {MANIFEST_NAME}")


def read_manifest_bytes(storage: Storage, path: str) -> bytes:
    try:
        return _read_member(storage, path, MANIFEST_NAME, limit=MAX_MANIFEST_BYTES)
    except CheckpointNotFoundError:
        raise CommitError(f"{storage.url(path)}: {MANIFEST_NAME} is missing") from None


def open_checkpoint(path: str, *, storage_options: dict | None = None,
                    storage: Storage | None = None, whole: bool = True) -> Checkpoint:
    """Open a committed checkpoint; raise if it is uncommitted, edited or unreadable.

    A v2 checkpoint's manifest comes ``whole`` (every file and shard, read from every rank
    index and header: ``resolve.expand``), or as its root alone (``whole=False``: what a load
    resolves its own part from)."""
    if storage is None:
        storage, path = get_storage(path, storage_options)
    path = resolve_path(storage, path)
    commit = read_commit(storage, path)
    raw = read_manifest_bytes(storage, path)
    got = hashing.digest_bytes(raw)
    if got != commit.manifest_digest:
        raise IntegrityError(f"{path}/{MANIFEST_NAME}: hashes to {got}, {COMMITTED_NAME} records "
                             f"{commit.manifest_digest} (changed after the commit)")
    manifest = parse_manifest(raw, source=f"{path}/{MANIFEST_NAME}")
    if manifest.save_id != commit.save_id:
        raise IntegrityError(f"{path}: manifest save_id {manifest.save_id!r} != {COMMITTED_NAME} "
                             f"save_id {commit.save_id!r}")
    if manifest.format_version != commit.format_version:
        raise IntegrityError(f"{path}: manifest format version {manifest.format_version} != {COMMITTED_NAME}'s "
                             f"{commit.format_version}")
    refs.check_chain_of(path, manifest)
    if whole:
        manifest = expand(storage, path, manifest)
    return Checkpoint(storage=storage, path=path, manifest=manifest, commit=commit)


def read_manifest(path: str, *, storage_options: dict | None = None) -> Manifest:
    """Return the manifest of the committed checkpoint at ``path`` (a v2 one whole: every file
    and shard, read from its rank indexes and headers)."""
    return open_checkpoint(path, storage_options=storage_options).manifest


def shard_key_ok(fqn: str, shard: ShardRecord) -> bool:
    """Whether ``shard.key`` is one the format allows for this tensor and slice."""
    return shard.key == fqn or shard.key == f"{fqn}@{','.join(map(str, shard.offsets))}"


def check_headers(storage: Storage, path: str, manifest: Manifest,
                  shards: Iterable[tuple[str, ShardRecord]]) -> None:
    """Read and verify the header of every file ``shards`` come from (exactly its
    ``header_size`` bytes, against ``header_digest``); check each shard's key, dtype, shape
    and byte range against it. Raise on the first mismatch.

    This is what stops a manifest whose byte ranges point at the wrong (but intact) bytes.
    """
    by_file: dict[str, list[tuple[str, ShardRecord]]] = {}
    for fqn, shard in shards:
        by_file.setdefault(shard.file, []).append((fqn, shard))
    names = sorted(by_file)
    if storage.remote and len(names) > 1:  # a round trip each: issue them together
        with ThreadPoolExecutor(max_workers=min(len(names), storage.read_concurrency)) as ex:
            for f in [ex.submit(_check_file_header, storage, path, manifest, n, by_file[n]) for n in names]:
                f.result()
        return
    for name in names:
        _check_file_header(storage, path, manifest, name, by_file[name])


def _check_file_header(storage: Storage, path: str, manifest: Manifest, name: str,
                       shards: list[tuple[str, ShardRecord]]) -> None:
    frec = manifest.files[name]
    header = read_header(storage, path, name, frec, verify=True)  # size, digest, length prefix, rules
    origins = decode_origins(header.metadata, source=name)
    for fqn, shard in shards:
        e = header.entries.get(shard.key)
        rec = manifest.tensor(fqn)
        if not shard_key_ok(fqn, shard) or e is None:
            raise HeaderError(f"{name}: tensor {fqn!r}: key {shard.key!r} is not this tensor's entry")
        o = origins.get(shard.key)
        if o is None or (o.fqn, o.offsets, o.global_shape) != (fqn, tuple(shard.offsets), tuple(rec.shape)):
            raise HeaderError(f"{name}: tensor {fqn!r}: the file places key {shard.key!r} at "
                              f"{None if o is None else (o.fqn, list(o.offsets), list(o.global_shape))}, "
                              f"the manifest at offsets {list(shard.offsets)} of shape {list(rec.shape)}")
        if (e.dtype, e.shape, (e.start, e.end)) != (rec.dtype, tuple(shard.lengths), tuple(shard.byte_range)):
            raise HeaderError(f"{name}: tensor {fqn!r}: header says {e.dtype} {list(e.shape)} at "
                              f"[{e.start}, {e.end}), manifest says {rec.dtype} {list(shard.lengths)} at "
                              f"{list(shard.byte_range)}")
