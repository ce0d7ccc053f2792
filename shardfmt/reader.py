"""Opening a committed checkpoint: COMMITTED first, then the manifest it vouches for.

A checkpoint exists only if ``COMMITTED`` is present and the manifest's digest matches the
one it records; anything else is refused before a single data byte is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import hashing
from .commit import committed_aside
from .errors import CheckpointNotFoundError, CommitError, IntegrityError
from .manifest import (
    COMMITTED_NAME,
    MANIFEST_NAME,
    MAX_COMMITTED_BYTES,
    MAX_MANIFEST_BYTES,
    CommitRecord,
    Manifest,
    parse_commit,
    parse_manifest,
)
from .storage import Storage, get_storage


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A committed checkpoint, opened: where it is and what its manifest says."""

    storage: Storage
    path: str
    manifest: Manifest
    commit: CommitRecord


def resolve_path(storage: Storage, path: str) -> str:
    """Return ``path``, or the committed ``<path>.old-*`` an interrupted overwrite left."""
    if storage.exists(path):
        return path
    aside = committed_aside(storage, path)
    if aside is not None:
        return aside
    raise CheckpointNotFoundError(f"{path}: no checkpoint there")


def read_commit(storage: Storage, path: str) -> CommitRecord:
    marker = storage.join(path, COMMITTED_NAME)
    if not storage.exists(marker):
        raise CommitError(f"{path}: not committed (no {COMMITTED_NAME} marker: an interrupted or "
                          "in-progress save)")
    return parse_commit(storage.read_bytes(marker, limit=MAX_COMMITTED_BYTES), source=marker)


def read_manifest_bytes(storage: Storage, path: str) -> bytes:
    where = storage.join(path, MANIFEST_NAME)
    if not storage.exists(where):
        raise CommitError(f"{path}: {MANIFEST_NAME} is missing")
    return storage.read_bytes(where, limit=MAX_MANIFEST_BYTES)


def open_checkpoint(path: str, *, storage_options: dict | None = None,
                    storage: Storage | None = None) -> Checkpoint:
    """Open a committed checkpoint; raise if it is uncommitted, edited or unreadable."""
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
    return Checkpoint(storage=storage, path=path, manifest=manifest, commit=commit)


def read_manifest(path: str, *, storage_options: dict | None = None) -> Manifest:
    """Return the manifest of the committed checkpoint at ``path``."""
    return open_checkpoint(path, storage_options=storage_options).manifest
