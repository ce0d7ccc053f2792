"""Incremental saves: the shards a rank takes from its base instead of writing them again.

A save given a base (``SaveOptions.base``: an earlier committed checkpoint next to the new
one) writes only the shards whose bytes changed (spec/FORMAT.md section 4.10)::

    1) rank 0 reads the base's root: the save's hash chunk is the base's (shard digests
       compare only under one chunk size), broadcast in the write plan
    2) every rank reads its own part of the base (``read_base``): the base's rank-table
       part, its own rank index and its files' headers, each checked against the digest
       that vouches for it. What it costs follows the rank's own data, never the job
    3) for every box the rank writes, a box the base's same rank wrote with the same record
       name, offsets, dtype, lengths and tensor shape is a candidate; its bytes are hashed
       into a shard digest (section 6) and, equal to the base's, the box is *taken*: the
       rank's index lists the base's file (``<base>/data/...``) with the keys it takes, and
       the rank's own file holds only the boxes that changed (``Base.take``)
    4) the ranks report the bases they took from (``Written.chain``); rank 0 records the
       chain in the root's required ``incremental`` extension and commits

Why a content digest and not a cheaper signal (``requires_grad``, a tensor's version
counter): a frozen tensor changed through ``.data`` or by a loader keeps both, and a wrong
"unchanged" would commit old bytes silently. Hashing runs at several GB/s a core, far faster
than the write it saves; a box whose digest differs is written as usual.

A base that cannot be read (gone, corrupt, another format) makes a full save, with a warning:
an incremental save never depends on what it could not verify.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import IntegrityError, ManifestError, ShardfmtError, StateDictError
from shardfmt.format import hashing, refs
from shardfmt.format.dtypes import dtype_code
from shardfmt.format.index import IndexedFile
from shardfmt.format.manifest import (
    COMMITTED_NAME,
    MANIFEST_NAME,
    MAX_COMMITTED_BYTES,
    MAX_MANIFEST_BYTES,
    Manifest,
)
from shardfmt.format.parse import parse_commit, parse_manifest
from shardfmt.format.tensor_bytes import byte_pieces, byte_view, is_direct
from shardfmt.io.documents import read_headers, read_indexes
from shardfmt.io.store import Storage
from shardfmt.saving.plan import WriteItem

log = logging.getLogger("shardfmt")

Place = tuple[str, tuple[int, ...]]  # (record name, offsets)


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseShard:
    """A box the base's rank wrote: where it is (as the new checkpoint names the file) and its digest."""

    file: str  # the file's name in the new checkpoint's index: ``<base>/data/...``
    key: str
    dtype: str
    lengths: tuple[int, ...]
    global_shape: tuple[int, ...]
    digest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Base:
    """One rank's part of its save's base: what it may take, and the chain a reference joins."""

    name: str  # the base checkpoint's name (a sibling of the new one)
    save_id: str
    chunk_size: int
    chain: refs.Chain | None  # the base's own chain (None: a full checkpoint)
    files: Mapping[str, IndexedFile] = field(default_factory=dict)  # new-index name -> the base's record
    shards: Mapping[Place, BaseShard] = field(default_factory=dict)
    owners: Mapping[str, str] = field(default_factory=dict)  # a base name -> its save id (the base and its bases)

    def take(self, items: Sequence[WriteItem], chunk_size: int, digest_of: Callable[[int], str]
             ) -> tuple[list[WriteItem], dict[str, IndexedFile], list[tuple[WriteItem, str]]]:
        """The items still to write, the base files (with the keys taken) that hold the others,
        and those others with their shard digests. ``digest_of(i)`` is item ``i``'s shard digest
        under ``chunk_size`` (``Digests``), asked only of candidates. Nothing is taken under
        another chunk size: digests would not compare."""
        if chunk_size != self.chunk_size or not self.shards:
            return list(items), {}, []
        write, taken, kept = [], {}, []
        for i, it in enumerate(items):
            got = self.shards.get((it.fqn, it.box.offsets))
            if got is not None and _same(got, it) and digest_of(i) == got.digest:
                taken.setdefault(got.file, []).append(got.key)
                kept.append((it, got.digest))
            else:
                write.append(it)
        return write, {name: _with_keys(self.files[name], keys) for name, keys in sorted(taken.items())}, kept

    def chain_for(self, names: Sequence[str]) -> refs.Chain | None:
        """The chain of a checkpoint whose index references the files ``names`` (None: none)."""
        bases = {b: self.owners[b] for b in (refs.split(n)[0] for n in names) if b is not None}
        if not bases:
            return None
        return refs.Chain(bases=bases, depth=1 if self.chain is None else self.chain.depth + 1)


class Digests:
    """The items' shard digests, computed by ``workers`` threads from the start (``start``), so the
    hashing overlaps the base being read; ``of(i)`` waits for item ``i``'s. Leaving the context
    drops what is not yet hashed."""

    def __init__(self, items: Sequence[WriteItem], chunk_size: int, *, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="shardfmt-digest")
        self._futures = [self._pool.submit(_digest, it, chunk_size) for it in items]

    def of(self, i: int) -> str:
        return self._futures[i].result()

    def __enter__(self) -> Digests:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _same(got: BaseShard, it: WriteItem) -> bool:
    return (got.dtype, got.lengths, got.global_shape) == (dtype_code(it.data.dtype, what=it.fqn), it.box.lengths,
                                                           tuple(it.global_shape))


def _digest(it: WriteItem, chunk_size: int) -> str:
    """The shard digest (spec section 6) of the item's bytes, as a file of this save would record it."""
    if it.ready is not None:
        it.ready()
    data = it.data
    return hashing.shard_digest([byte_view(data)] if is_direct(data) else byte_pieces(data), chunk_size)


def _with_keys(rec: IndexedFile, keys: list[str]) -> IndexedFile:
    return IndexedFile(size=rec.size, header_size=rec.header_size, header_digest=rec.header_digest,
                       digest=rec.digest, chunks=rec.chunks, keys=tuple(sorted(keys)))


def read_root(storage: Storage, path: str) -> Manifest:
    """The committed root manifest at ``path`` (COMMITTED read first, the manifest checked against it)."""
    commit = parse_commit(storage.read_bytes(storage.join(path, COMMITTED_NAME), limit=MAX_COMMITTED_BYTES,
                                             within=path), source=f"{path}/{COMMITTED_NAME}")
    raw = storage.read_bytes(storage.join(path, MANIFEST_NAME), limit=MAX_MANIFEST_BYTES, within=path)
    if hashing.digest_bytes(raw) != commit.manifest_digest:
        raise IntegrityError(f"{path}/{MANIFEST_NAME}: does not match the digest its {COMMITTED_NAME} records")
    m = parse_manifest(raw, source=f"{path}/{MANIFEST_NAME}")
    if m.save_id != commit.save_id:
        raise IntegrityError(f"{path}: manifest save_id {m.save_id!r} != {COMMITTED_NAME}'s {commit.save_id!r}")
    return m


def base_name(path: str, base: str) -> str:
    """The name of ``base`` as a sibling of ``path``; a base elsewhere is refused (section 4.10)."""
    name = base.rstrip("/").rpartition("/")[2]
    if base.rstrip("/") == path.rstrip("/"):
        raise StateDictError(f"base={base}: is the checkpoint being written; an incremental save's base is an "
                             "earlier checkpoint next to it")
    if refs.sibling(path, name) != base.rstrip("/"):
        raise StateDictError(f"base={base}: an incremental save's base must be a checkpoint next to it "
                             f"(in the directory of {path})")
    try:
        return refs.check_base(name, "base=")
    except ManifestError as e:
        raise StateDictError(str(e)) from None


def read_base(storage: Storage, path: str, base: str, rank: int, root: Manifest | None = None) -> Base:
    """Step 2: rank ``rank``'s part of ``base`` (a sibling of ``path``), read and checked."""
    name = base_name(path, base)
    if commit_strategy(storage).marked_quarantined(base):  # object stores set a bad checkpoint aside in place
        raise IntegrityError(f"{base}: quarantined (found unusable by a restore)")
    m = root if root is not None else read_root(storage, base)
    if m.format_version < 2:
        raise ShardfmtError(f"{base}: format version {m.format_version}; an incremental save needs a version-2 base")
    chain = refs.chain_of(m)
    owners = {name: m.save_id, **({} if chain is None else chain.bases)}
    indexes = read_indexes(storage, base, m, [rank], required=False)
    files: dict[str, IndexedFile] = {}
    shards: dict[Place, BaseShard] = {}
    for f in read_headers(storage, base, m, indexes, verify=True).get(rank, []):
        seen = f.name if refs.split(f.name)[0] is not None else refs.ref_name(name, f.name)
        files[seen] = f.record
        for key, o in f.origins.items():
            e = f.header.entries[key]
            span = f.grid.span(e.start, e.end)
            shards[(o.fqn, tuple(o.offsets))] = BaseShard(
                file=seen, key=key, dtype=e.dtype, lengths=tuple(e.shape), global_shape=tuple(o.global_shape),
                digest=hashing.digest_bytes(f.record.chunks[16 * span.start:16 * span.stop]))  # = combine()
    return Base(name=name, save_id=m.save_id, chunk_size=m.chunk_size, chain=chain, files=files, shards=shards,
                owners=owners)


def try_read_base(storage: Storage, path: str, base: str, rank: int, root: Manifest | None = None) -> Base | None:
    """``read_base``, or None with a warning when the base cannot be used (the save is then full)."""
    try:
        return read_base(storage, path, base, rank, root)
    except (ShardfmtError, OSError) as e:
        log.warning("shardfmt: rank %d writes a full checkpoint to %s: its base %s cannot be used (%s)",
                    rank, path, base, e)
        return None


__all__ = ["Base", "BaseShard", "Digests", "base_name", "read_base", "read_root", "try_read_base"]
