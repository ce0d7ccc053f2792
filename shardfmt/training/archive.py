"""Copying a committed checkpoint to another storage (the archive tier), verified, then committed.

``copy_checkpoint(src, dst)``::

    1) open the source (COMMITTED + manifest); stage the destination (spec section 7:
       a ``.tmp-`` dir on local disk, the prefix itself with a LEASE on an object store)
    2) stream every data file across in ``piece``-sized ranged reads, hashing each chunk on
       the way and refusing to pass on a chunk that does not match the manifest
    3) verify the copy where it now lies: re-read every file there and check its header and
       every chunk hash against the manifest

An incremental checkpoint's bases (spec/FORMAT.md section 4.10) are copied first, each under
its own name next to ``dst_path`` (a base already there, committed by the same save, is kept):
the copy references them as the original does.
    4) commit there: the same manifest bytes, then its own ``COMMITTED``

Memory is one ``piece`` buffer plus the destination writer's parts. A failure at any step
removes what was staged; nothing half-copied is ever committed. Retries (with backoff) are
the caller's: ``copy_with_retries``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shardfmt.commit import protocol as _commit
from shardfmt.errors import CheckpointExistsError, IntegrityError, ShardfmtError
from shardfmt.format import hashing, refs
from shardfmt.format.manifest import DATA_DIR, INDEX_DIR, FileRecord, Manifest
from shardfmt.io.documents import rank_entries, read_vouched
from shardfmt.io.store import Storage, reserve
from shardfmt.loading.reader import open_checkpoint
from shardfmt.validation import check_files

COPY_PIECE = 16 << 20


def copy_checkpoint(src_storage: Storage, src_path: str, dst_storage: Storage, dst_path: str,
                    *, piece: int = COPY_PIECE, verify: bool = True) -> Manifest:
    """Copy the committed checkpoint at ``src_path`` to ``dst_path``; return its manifest.

    Raises CheckpointExistsError if ``dst_path`` is already committed (with the same save id
    it is simply returned: the copy was made before).
    """
    ckpt = open_checkpoint(src_path, storage=src_storage)
    m = ckpt.manifest
    for base in sorted(refs.bases_of(m)):  # an incremental checkpoint carries its bases (spec section 4.10)
        copy_checkpoint(src_storage, refs.sibling(ckpt.path, base), dst_storage, refs.sibling(dst_path, base),
                        piece=piece, verify=verify)
    if _commit.is_committed(dst_storage, dst_path):
        there = open_checkpoint(dst_path, storage=dst_storage)
        if there.manifest.save_id == m.save_id:
            return there.manifest
        raise CheckpointExistsError(f"{dst_storage.url(dst_path)}: holds another checkpoint "
                                    f"(save {there.manifest.save_id}, not {m.save_id})")
    staging = _commit.prepare(dst_storage, dst_path, m.save_id, overwrite=False)
    lease = _commit.Heartbeat(dst_storage, staging, dst_storage.lease_seconds, m.save_id)
    try:
        dst_storage.makedirs(dst_storage.join(staging, DATA_DIR))
        buf = bytearray(max(m.chunk_size, piece // m.chunk_size * m.chunk_size))
        for name in sorted(n for n in m.files if refs.split(n)[0] is None):  # a base's files: copied with it
            copy_file(ckpt.storage, ckpt.path, dst_storage, staging, name, m.files[name], m.chunk_size, buf)
        del buf
        if m.format_version >= 2:
            _copy_indexes(ckpt.storage, ckpt.path, dst_storage, staging, m)
        if verify:
            problems = check_files(dst_storage, staging, m, deep=True)
            if problems:
                raise IntegrityError(f"{dst_storage.url(dst_path)}: the copy does not verify: "
                                     + "; ".join(str(p) for p in problems[:3]))
        _commit.publish(dst_storage, dst_path, staging, m, required=_own_files(m))
    except BaseException:
        lease.stop()
        if staging != dst_path or not _commit.is_committed(dst_storage, dst_path):
            _commit.abort(dst_storage, staging)  # never a committed copy (ours, its reply lost, or a racer's)
        raise
    lease.stop(release=True)
    return m


def _own_files(m: Manifest) -> list[str] | None:
    """What the copy's commit requires still there: its own data files (v1: the manifest's)."""
    if m.format_version < 2:
        return None
    return sorted(n for n in m.files if refs.split(n)[0] is None)


def copy_file(src: Storage, src_root: str, dst: Storage, dst_root: str, name: str, frec: FileRecord,
              chunk_size: int, buf: bytearray) -> None:
    """Stream the data file ``name`` across in ``len(buf)`` pieces, refusing (IntegrityError) to
    pass on a header or chunk that does not match ``frec``."""
    reader = src.open_reader(src.join(src_root, name), size=frec.size, within=src_root)
    writer = dst.open_writer(dst.join(dst_root, name))
    grid = frec.grid(chunk_size)
    hasher = grid.hasher(grid.chunked_from)  # v2: the header is checked by its digest, not chunked
    view = memoryview(buf)
    try:
        reserve(writer, frec.size)
        pos = 0
        while pos < frec.size:
            n = min(len(buf), frec.size - pos)
            reader.readinto(pos, [view[:n]])
            first = len(hasher.completed)
            skip = min(max(grid.chunked_from - pos, 0), n)
            if skip and hashing.digest_bytes(view[:grid.chunked_from]) != frec.header_digest:
                raise IntegrityError(f"{src.url(src.join(src_root, name))}: header does not match its "
                                     "digest; not archiving a corrupt checkpoint")
            hasher.update(view[skip:n])
            done = hasher.completed
            for k in range(first, len(done)):
                if done[k] != frec.chunks[k]:
                    raise IntegrityError(f"{src.url(src.join(src_root, name))}: chunk {k} hashes to {done[k]}, "
                                         f"manifest says {frec.chunks[k]}; not archiving a corrupt checkpoint")
            writer.write(view[:n])
            pos += n
        if hasher.finish() != list(frec.chunks):
            raise IntegrityError(f"{src.url(src.join(src_root, name))}: last chunk does not match the manifest")
    except BaseException:
        writer.abort()
        raise
    finally:
        reader.close()
    writer.close()


def _copy_indexes(src: Storage, src_root: str, dst: Storage, dst_root: str, m: Manifest) -> None:
    """v2: copy the rank table's parts and every rank index, each checked against its digest."""
    dst.makedirs(dst.join(dst_root, INDEX_DIR))
    ranks = [r for p in m.ranks for r in range(p.first, p.end)]
    docs = [(p.name, p.size, p.digest) for p in m.ranks]
    docs += [(e.name, e.size, e.digest) for _, e in sorted(rank_entries(src, src_root, m, ranks, required=False).items())]
    for name, size, digest in docs:
        dst.write_bytes(dst.join(dst_root, name), read_vouched(src, src_root, name, size, digest))


def copy_with_retries(copy: Callable[[], Manifest], *, attempts: int = 4, backoff: float = 1.0,
                      on_retry: Callable[[int, BaseException], None] | None = None) -> Manifest:
    """Run ``copy`` up to ``attempts`` times, sleeping ``backoff * 2**i`` between tries."""
    for i in range(attempts):
        try:
            return copy()
        except CheckpointExistsError:
            raise
        except (ShardfmtError, OSError) as e:
            if i == attempts - 1:
                raise
            if on_retry is not None:
                on_retry(i + 1, e)
            time.sleep(min(backoff * 2 ** i, 300.0))  # capped: never days between tries
    raise AssertionError("unreachable")
