"""Storage on fsspec filesystems, object stores (S3 through s3fs) first.

Object stores cannot rename a directory, so there is no staging dir: a save writes its data
objects and manifest straight under the checkpoint's prefix and the ``COMMITTED`` object,
written last and only if absent, is the commit (spec section 7). What this module adds over
plain fsspec:

- **Errors that say what happened**: a missing bucket, refused credentials, an unreachable
  endpoint or a server error become one ``StorageError`` naming the URL and the cause; the
  client is configured with timeouts and bounded retries, so nothing hangs.
- **Ranged reads** of exactly the bytes asked for (one GET each), and a larger ``max_gap``
  than local disk: on S3 a request costs a round trip, worth megabytes of transfer.
- **Streaming multipart uploads** (S3): a data file goes up in ``part_size`` parts,
  ``write_concurrency`` at a time; at most ``write_concurrency + 1`` parts are ever in memory,
  never the whole file. An upload that fails is aborted, so it leaves no parts behind.
- **Leases as objects**: a save in progress keeps ``<path>/LEASE`` fresh (its LastModified is
  the lease time); collectors use it to tell a dead save from a live one.

Every request is counted in ``storage.stats``.
"""

from __future__ import annotations

import os
import posixpath
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import orjson

from shardfmt.errors import (
    AccessDeniedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    ShardfmtError,
    StorageError,
)
from shardfmt.format.manifest import LEASE_NAME
from shardfmt.format.tensor_bytes import BufferFile
from shardfmt.io.storage import PROCESS_IO, FileReader, IOStats, LocalStorage

OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "oss", "r2"})

# The S3 client's defaults unless the caller's storage_options say otherwise: fail within
# seconds on an unreachable endpoint, retry transient errors a bounded number of times.
S3_CONFIG_DEFAULTS = {"connect_timeout": 10, "read_timeout": 120,
                      "retries": {"max_attempts": 4, "mode": "standard"}}
S3_PART_SIZE = 16 << 20       # multipart part size (S3 requires >= 5 MiB for all but the last)
S3_WRITE_CONCURRENCY = 4      # parts of one file in flight at once
S3_MAX_GAP = 4 << 20          # a GET's round trip is worth ~4 MiB of transfer
S3_READ_CONCURRENCY = 8
OBJECT_STORE_LEASE_SECONDS = 120.0
_PARTS_PER_SIZE_STEP = 2000   # part size doubles every 2000 parts: S3 allows 10,000 per upload


def _is_missing_bucket(e: BaseException) -> bool:
    return "bucket" in str(e).lower() and ("not exist" in str(e).lower() or "nosuchbucket" in str(e).lower())


def translate_error(url: str, e: BaseException, what: str) -> StorageError:
    """One typed error naming ``url``, the operation and the cause, for any client failure."""
    if isinstance(e, StorageError):
        return e
    msg = str(e) or type(e).__name__
    if isinstance(e, FileNotFoundError):
        if _is_missing_bucket(e):
            return StorageError(f"{url}: {what} failed: the bucket does not exist ({msg})")
        return CheckpointNotFoundError(f"{url}: does not exist ({what})")
    if isinstance(e, FileExistsError):
        return CheckpointExistsError(f"{url}: already exists ({what})")
    if isinstance(e, PermissionError):
        return AccessDeniedError(f"{url}: {what} failed: access denied: {msg} (check the credentials, "
                                 "e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options, and "
                                 "the bucket's permissions)")
    name = type(e).__name__
    if "EndpointConnection" in name or "ConnectTimeout" in name or "ClientConnector" in name \
            or isinstance(e, (ConnectionError, TimeoutError)):
        return StorageError(f"{url}: {what} failed: cannot reach the storage endpoint ({msg})")
    return StorageError(f"{url}: {what} failed: {name}: {msg}")


class _Reader:
    """Ranged reads: one GET per call, whatever its size, scattered into the caller's buffers.

    On S3 the response body is streamed straight into the buffers (no copy of the whole
    range in between); other filesystems return the range as bytes, then it is scattered.
    """

    __slots__ = ("_st", "_path", "size")

    def __init__(self, st: FsspecStorage, path: str, size: int | None) -> None:
        self._st = st
        self._path = path
        self.size = st.size(path) if size is None else size

    def readinto(self, offset: int, buffers: Sequence[memoryview]) -> None:
        want = sum(len(b) for b in buffers)
        if want == 0:
            return
        if self._st.multipart:
            self._st._call(self._path, "read", self._stream, offset, want, buffers)
        else:
            data = self._st._call(self._path, "read", self._st.fs.cat_file, self._path,
                                  start=offset, end=offset + want)
            if len(data) != want:
                raise IntegrityError(f"{self._st.url(self._path)}: short read at byte {offset} "
                                     f"({len(data)} of {want} bytes; truncated?)")
            pos = 0
            for b in buffers:
                b[:] = memoryview(data)[pos : pos + len(b)]
                pos += len(b)
        self._st.stats.add_read(want)

    def _stream(self, offset: int, want: int, buffers: Sequence[memoryview]) -> None:
        from fsspec.asyn import sync

        fs = self._st.fs
        bucket, key, _ = fs.split_path(self._path)

        async def get() -> None:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key,
                                     Range=f"bytes={offset}-{offset + want - 1}")
            body = resp["Body"]
            try:
                self._check_range(resp, offset, want)
                got = 0
                for b in buffers:
                    pos = 0
                    while pos < len(b):
                        piece = await body.read(min(len(b) - pos, 4 << 20))
                        if not piece:
                            raise IntegrityError(f"{self._st.url(self._path)}: ends at byte {offset + got}, "
                                                 f"before the {want} bytes wanted from {offset} (truncated?)")
                        b[pos : pos + len(piece)] = piece
                        pos += len(piece)
                        got += len(piece)
            finally:
                body.close()

        for attempt in range(3):  # the body can fail mid-stream; the range is simply asked again
            try:
                return sync(fs.loop, get)
            except (StorageError, IntegrityError, FileNotFoundError, PermissionError):
                raise
            except Exception as e:  # noqa: BLE001
                code = (getattr(e.__cause__, "response", None) or {}).get("Error", {}).get("Code")
                if code == "InvalidRange" or "InvalidRange" in str(e) or "416" in str(e):
                    raise IntegrityError(f"{self._st.url(self._path)}: bytes from {offset} are past its end "
                                         "(truncated?)") from None
                if attempt == 2:
                    raise
                time.sleep(0.2 * 2 ** attempt)  # transient transfer errors: retried, then reported

    def _check_range(self, resp: dict, offset: int, want: int) -> None:
        """The object's size (from Content-Range, at no extra request) must be the one expected,
        and the body the range asked for: a store or proxy ignoring Range sends the whole object."""
        where = self._st.url(self._path)
        cr = resp.get("ContentRange")
        if cr is None:
            if offset != 0 or resp.get("ContentLength") != want:
                raise IntegrityError(f"{where}: the store ignored the byte range {offset}-{offset + want - 1}")
            total = self.size if want == self.size else None
        else:
            try:
                total = int(cr.rsplit("/", 1)[1])
                start = int(cr.split()[1].split("-")[0])
            except (IndexError, ValueError):
                raise IntegrityError(f"{where}: unreadable Content-Range {cr!r}") from None
            if start != offset:
                raise IntegrityError(f"{where}: asked for bytes from {offset}, got from {start}")
        if total is not None and total != self.size:
            raise IntegrityError(f"{where}: is {total} bytes, the manifest says {self.size} (changed after the save?)")

    def prefetch(self, offset: int, length: int) -> None:
        """No read-ahead hint on object stores: each read is one request already."""

    def close(self) -> None:
        pass


class _StreamWriter:
    """Generic fsspec: the filesystem's own buffered file."""

    __slots__ = ("_st", "_f", "_path")

    def __init__(self, st: FsspecStorage, path: str) -> None:
        self._st = st
        self._path = path
        self._f = st._call(path, "create", st.fs.open, path, "wb")

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self._st._call(self._path, "write", self._f.write, mv)
        self._st.stats.add_write(len(mv))

    def close(self, *, sync: bool = True) -> None:
        self._st._call(self._path, "close", self._f.close)

    def abort(self) -> None:
        discard = getattr(self._f, "discard", None)
        try:
            (discard or self._f.close)()
        except Exception:  # noqa: BLE001 - best effort on an already failing path
            pass


class _MultipartWriter:
    """S3: stream a file up as a multipart upload, parts in parallel, memory bounded.

    Bytes fill one ``part_size`` buffer; a full buffer is handed to an upload thread and a
    fresh one started. At most ``concurrency`` uploads run at once (``write`` blocks for a free
    slot), so at most ``concurrency + 1`` part buffers exist. A file smaller than one part is
    a single PUT. Any failure aborts the upload: S3 keeps nothing of it.
    """

    def __init__(self, st: FsspecStorage, path: str, part_size: int, concurrency: int) -> None:
        self._st = st
        self._path = path
        self._bucket, self._key, _ = st.fs.split_path(path)
        self._base = part_size
        # Part buffers are reused (at most concurrency + 1 ever exist): freeing and allocating
        # a part per upload lets the C allocator keep the freed blocks, and RSS creeps.
        self._free: list[bytearray] = []
        self._buf = bytearray(part_size)
        self._fill = 0
        self._upload_id: str | None = None
        self._parts: dict[int, str] = {}
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool: ThreadPoolExecutor | None = None
        self._concurrency = concurrency
        self._futures: list[Future] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _part_size(self) -> int:
        return self._base << (len(self._futures) // _PARTS_PER_SIZE_STEP)

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        pos, n = 0, len(mv)
        while pos < n:
            if self._error is not None:
                raise translate_error(self._st.url(self._path), self._error, "upload")
            size = self._part_size()
            if len(self._buf) != size:
                self._buf = self._take(size)
            take = min(size - self._fill, n - pos)
            self._buf[self._fill : self._fill + take] = mv[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == size:
                self._submit()

    def _submit(self) -> None:
        if self._upload_id is None:
            out = self._st._call(self._path, "start multipart upload", self._st.fs.call_s3,
                                 "create_multipart_upload", Bucket=self._bucket, Key=self._key)
            self._st.stats.add_write(0)
            self._upload_id = out["UploadId"]
            self._pool = ThreadPoolExecutor(max_workers=self._concurrency, thread_name_prefix="shardfmt-upload")
        body, fill = self._buf, self._fill
        number = len(self._futures) + 1
        self._slots.acquire()  # blocks while `concurrency` parts are in flight
        try:
            self._futures.append(self._pool.submit(self._upload, number, body, fill))
        except BaseException:
            self._slots.release()
            raise
        self._buf, self._fill = self._take(self._part_size()), 0

    def _take(self, size: int) -> bytearray:
        with self._lock:
            while self._free:
                buf = self._free.pop()
                if len(buf) == size:
                    return buf
        return bytearray(size)

    def _upload(self, number: int, body: bytearray, fill: int) -> None:
        try:
            if self._error is not None:
                return
            out = self._st.fs.call_s3("upload_part", Bucket=self._bucket, Key=self._key,
                                      UploadId=self._upload_id, PartNumber=number,
                                      Body=BufferFile(memoryview(body)[:fill]), ContentLength=fill)
            with self._lock:
                self._parts[number] = out["ETag"]
            self._st.stats.add_write(fill)
        except BaseException as e:  # noqa: BLE001 - reported by write/close
            with self._lock:
                if self._error is None:
                    self._error = e
        finally:
            with self._lock:
                self._free.append(body)
            self._slots.release()

    def close(self, *, sync: bool = True) -> None:
        url = self._st.url(self._path)
        if self._upload_id is None:  # smaller than one part: one PUT
            self._st._call(self._path, "write", self._st.fs.pipe_file, self._path,
                           bytes(memoryview(self._buf)[: self._fill]))
            self._st.stats.add_write(self._fill)
            self._buf = bytearray()
            return
        try:
            if self._fill:
                self._submit()
            for f in self._futures:
                f.result()
            if self._error is not None:
                raise translate_error(url, self._error, "upload")
            parts = [{"PartNumber": n, "ETag": self._parts[n]} for n in sorted(self._parts)]
            self._st._call(self._path, "complete multipart upload", self._st.fs.call_s3,
                           "complete_multipart_upload", Bucket=self._bucket, Key=self._key,
                           UploadId=self._upload_id, MultipartUpload={"Parts": parts})
            self._st.stats.add_write(0)
            self._st.fs.invalidate_cache(self._path)
        except BaseException:
            self.abort()
            raise
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._buf = bytearray()
        self._free.clear()

    def abort(self) -> None:
        self._error = self._error or StorageError("aborted")
        self._shutdown()
        if self._upload_id is not None:
            try:
                self._st.fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                    UploadId=self._upload_id)
            except Exception:  # noqa: BLE001 - best effort; gc aborts stale uploads
                pass
            self._upload_id = None


class FsspecStorage:
    """Any fsspec filesystem. No atomic rename: the COMMITTED object, written last, commits.

    On fsspec's local filesystem (``local://``, and filesystems built on it) files are read,
    listed and removed as ``LocalStorage`` does: only regular files, opened without blocking
    and, under a checkpoint, through no symbolic link (spec section 2).
    """

    atomic_rename = False

    def __init__(self, fs: Any, *, protocol: str | None = None, part_size: int = S3_PART_SIZE,
                 write_concurrency: int = S3_WRITE_CONCURRENCY) -> None:
        self.fs = fs
        self.stats = IOStats(parent=PROCESS_IO)
        proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.protocol = protocol or proto
        self.object_store = self.protocol in OBJECT_STORE_PROTOCOLS
        self.multipart = hasattr(fs, "call_s3")
        self.max_gap = S3_MAX_GAP if self.object_store else 1 << 20
        self.read_concurrency = S3_READ_CONCURRENCY if self.object_store else (os.cpu_count() or 1)
        self.lease_seconds = OBJECT_STORE_LEASE_SECONDS
        self.part_size = part_size
        self.write_concurrency = write_concurrency
        from fsspec.implementations.local import LocalFileSystem

        self._disk: LocalStorage | None = None  # on fsspec's local filesystem: reads, listings, removals
        if isinstance(fs, LocalFileSystem):
            self._disk = LocalStorage()
            self._disk.stats = self.stats

    def url(self, path: str) -> str:
        return f"{self.protocol}://{path.lstrip('/')}" if self.protocol not in ("file", "local") else path

    def _call(self, path: str, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ShardfmtError:
            raise
        except Exception as e:  # noqa: BLE001 - every client failure becomes one typed error
            raise translate_error(self.url(path), e, what) from None

    def join(self, base: str, *parts: str) -> str:
        return posixpath.join(base, *parts)

    def exists(self, path: str) -> bool:
        return bool(self._call(path, "look up", self.fs.exists, path))

    def isdir(self, path: str) -> bool:
        return bool(self._call(path, "look up", self.fs.isdir, path))

    def size(self, path: str, *, within: str | None = None) -> int:
        if self._disk is not None:
            return self._disk.size(path, within=within)
        self.stats.add_read(0)
        return int(self._call(path, "stat", self.fs.size, path))

    def read_bytes(self, path: str, *, limit: int, within: str | None = None) -> bytes:
        if self._disk is not None:
            return self._disk.read_bytes(path, limit=limit, within=within)
        data = self._call(path, "read", self.fs.cat_file, path, start=0, end=limit + 1)
        self.stats.add_read(len(data))
        if len(data) > limit:
            raise IntegrityError(f"{self.url(path)}: larger than the {limit}-byte limit")  # not a storage failure
        return data

    def write_bytes(self, path: str, data: bytes, *, sync: bool = True, exclusive: bool = False) -> None:
        """Write a small object; ``exclusive`` writes only if it is absent (S3: If-None-Match)."""
        if exclusive and self.multipart:
            self._call(path, "write", self.fs.pipe_file, path, bytes(data), mode="create")
        else:
            if exclusive and self.exists(path):
                raise CheckpointExistsError(f"{self.url(path)}: already exists")
            self._call(path, "write", self.fs.pipe_file, path, bytes(data))
        self.stats.add_write(len(data))

    def open_writer(self, path: str):
        if self.multipart:
            return _MultipartWriter(self, path, self.part_size, self.write_concurrency)
        return _StreamWriter(self, path)

    def open_reader(self, path: str, size: int | None = None, *, within: str | None = None) -> FileReader:
        if self._disk is not None:
            return self._disk.open_reader(path, within=within)
        return _Reader(self, path, size)

    def makedirs(self, path: str) -> None:
        if self.object_store:
            return  # prefixes exist by having objects under them
        self._call(path, "mkdir", self.fs.makedirs, path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        entries = self._call(path, "list", self.fs.ls, path, detail=False)
        self.stats.add_read(0)
        return sorted({posixpath.basename(str(p).rstrip("/")) for p in entries} - {""})

    def remove_tree(self, path: str) -> None:
        """Remove every object under ``path`` (listed literally: never a glob) and ``path`` itself."""
        if self._disk is not None:
            self._disk.remove_tree(path)  # links inside are removed, never followed
            return
        keys = [self.join(path, rel) for rel in self.list_tree(path)]
        try:
            if keys:
                self.fs.rm(keys)
            if self.fs.isfile(path):
                self.fs.rm_file(path)
            elif not self.object_store:  # real directories: remove them too, deepest first
                dirs = [d for d, info in self.fs.find(path, withdirs=True, detail=True).items()
                        if info.get("type") == "directory"]
                for d in sorted(dirs, key=lambda d: -d.count("/")) + ([path] if self.fs.isdir(path) else []):
                    self.fs.rmdir(d)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise translate_error(self.url(path), e, "remove") from None
        self.fs.invalidate_cache(path)

    def rename(self, src: str, dst: str) -> None:
        raise StorageError(f"{self.url(src)}: this storage has no atomic rename")

    def exchange(self, a: str, b: str) -> None:
        raise StorageError(f"{self.url(a)}: this storage has no atomic exchange")

    def take_lease(self, path: str, owner: str = "") -> None:
        """Take the lease on ``path`` for save ``owner``: create its LEASE object only if absent."""
        try:
            self.write_bytes(self.join(path, LEASE_NAME),
                             orjson.dumps(dict(lease_identity(), time=time.time(), save_id=owner)), exclusive=True)
        except CheckpointExistsError:
            raise CheckpointExistsError(f"{self.url(path)}: another save started here at the same time") from None

    def touch(self, path: str, owner: str = "") -> bool:
        """Refresh the lease of save ``owner`` under ``path`` (its LEASE object); False, writing
        nothing, when the lease is gone or another save's: this save outlived its lease and the
        prefix was collected or taken over."""
        try:
            if owner and lease_owner(self, path) != owner:
                return False
            self.write_bytes(self.join(path, LEASE_NAME),
                             orjson.dumps(dict(lease_identity(), time=time.time(), save_id=owner)))
        except StorageError:
            pass  # a missed heartbeat shortens the lease; the save itself reports real failures
        return True

    def list_tree(self, path: str, *, within: str | None = None) -> list[str]:
        """Every object under ``path``, as paths relative to it."""
        if self._disk is not None:
            return self._disk.list_tree(path, within=within)
        base = path.rstrip("/") + "/"
        try:
            found = self.fs.find(path)
        except FileNotFoundError:
            return []
        except Exception as e:  # noqa: BLE001
            raise translate_error(self.url(path), e, "list") from None
        self.stats.add_read(0)
        return sorted(str(f)[len(base):] for f in found if str(f).startswith(base))

    def bucket_exists(self, path: str) -> bool:
        """Whether the bucket of ``path`` exists (S3; True elsewhere). Raise a StorageError naming
        ``path`` when the store cannot say (refused, unreachable): that is not a missing bucket."""
        if not self.multipart:
            return True
        bucket = self.fs.split_path(path)[0]
        try:
            self.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            return False
        except PermissionError as e:
            raise translate_error(self.url(path), e, "look up the bucket") from None
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"{self.url(path)}: the bucket {bucket!r} cannot be reached "
                               f"({type(e).__name__}: {e})") from None
        return True

    def check_bucket(self, path: str) -> None:
        """Raise a StorageError naming ``path`` unless its bucket exists and answers (S3)."""
        if not self.bucket_exists(path):
            raise StorageError(f"{self.url(path)}: the bucket {self.fs.split_path(path)[0]!r} does not exist")

    def mtime(self, path: str) -> float:
        """The lease time of ``path``: its LEASE object's, else its newest object's LastModified."""
        lease = self.join(path, LEASE_NAME)
        try:
            infos = [self.fs.info(lease)]
        except FileNotFoundError:
            try:
                infos = list(self.fs.find(path, detail=True).values()) if self.fs.isdir(path) \
                    else [self.fs.info(path)]
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"{self.url(path)}: does not exist") from None
            except Exception as e:  # noqa: BLE001
                raise translate_error(self.url(path), e, "stat") from None
        except Exception as e:  # noqa: BLE001
            raise translate_error(self.url(lease), e, "stat") from None
        return max((_info_time(i) for i in infos), default=0.0)

    def drop_lease(self, path: str) -> None:
        try:
            self.fs.rm_file(self.join(path, LEASE_NAME))
        except Exception:  # noqa: BLE001 - a leftover LEASE of a committed checkpoint is harmless
            pass

    def sync_dir(self, path: str) -> None:
        pass

    def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Multipart uploads begun and never completed under ``prefix``: (path, upload id, start time)."""
        if not self.multipart:
            return []
        bucket, key, _ = self.fs.split_path(prefix)
        out = self._call(prefix, "list multipart uploads", self.fs.call_s3, "list_multipart_uploads",
                         Bucket=bucket, Prefix=key.rstrip("/") + "/" if key else "")
        return [(f"{bucket}/{u['Key']}", u["UploadId"], _info_time({"LastModified": u.get("Initiated")}))
                for u in out.get("Uploads", [])]

    def abort_upload(self, path: str, upload_id: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        self._call(path, "abort multipart upload", self.fs.call_s3, "abort_multipart_upload",
                   Bucket=bucket, Key=key, UploadId=upload_id)


def read_lease(storage, path: str) -> dict:
    """The LEASE object under ``path`` as a dict ({} when unreadable); CheckpointNotFoundError
    when there is none."""
    try:
        info = orjson.loads(storage.read_bytes(storage.join(path, LEASE_NAME), limit=4096, within=path))
    except (ValueError, IntegrityError):
        return {}
    return info if isinstance(info, dict) else {}


def lease_owner(storage, path: str) -> str | None:
    """The save id in the LEASE under ``path`` ("" for a lease that names none), or None when
    there is no lease."""
    try:
        return str(read_lease(storage, path).get("save_id") or "")
    except CheckpointNotFoundError:
        return None


def lease_identity() -> dict:
    """Who holds a lease: host, pid namespace and pid (a pid means something only within both)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": os.uname().nodename, "pidns": pidns, "pid": os.getpid()}


def _info_time(info: dict) -> float:
    t = info.get("LastModified") or info.get("mtime") or info.get("created")
    if t is None:
        return 0.0
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


def _with_defaults(protocol: str, opts: dict) -> dict:
    opts = dict(opts)
    if protocol in ("s3", "s3a"):
        cfg = dict(S3_CONFIG_DEFAULTS)
        cfg.update(opts.get("config_kwargs") or {})
        opts["config_kwargs"] = cfg
        opts.setdefault("use_listings_cache", False)  # other processes write: never trust a cached listing
        if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
            opts.setdefault("endpoint_url", os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ["AWS_ENDPOINT_URL"])
    return opts


def fsspec_storage(url: str, storage_options: dict | None = None) -> tuple[FsspecStorage, str]:
    """The storage for an fsspec URL and the path to use with it."""
    import fsspec

    opts = dict(storage_options or {})
    part_size, concurrency = opts.pop("part_size", S3_PART_SIZE), opts.pop("write_concurrency", S3_WRITE_CONCURRENCY)
    lease = opts.pop("lease_seconds", OBJECT_STORE_LEASE_SECONDS)
    if not (type(part_size) is int and part_size >= 5 << 20 and type(concurrency) is int and concurrency >= 1
            and isinstance(lease, (int, float)) and lease > 0):
        raise StorageError(f"{url}: storage option part_size must be an integer >= 5 MiB (5242880), "
                           f"write_concurrency an integer >= 1, lease_seconds a positive number "
                           f"(got {part_size!r}, {concurrency!r}, {lease!r})")
    protocol = url.split("://", 1)[0]
    if protocol in OBJECT_STORE_PROTOCOLS and any(c in url for c in "*?[]"):
        raise StorageError(f"{url}: '*', '?', '[' and ']' are not allowed in object-store paths (fsspec would "
                           "expand them as patterns)")
    try:
        fs, path = fsspec.core.url_to_fs(url, **_with_defaults(protocol, opts))
    except (ImportError, ValueError, TypeError) as e:
        raise StorageError(f"{url}: no storage backend ({e})") from None
    if type(fs).__name__ == "S3FileSystem" and hasattr(fs, "retries"):
        # botocore already retries (S3_CONFIG_DEFAULTS); s3fs's own retries (5) around each of its
        # attempts multiply into ~80 requests a call: a hung endpoint took hours to report
        fs.retries = 1
    st = FsspecStorage(fs, part_size=part_size, write_concurrency=concurrency)
    st.lease_seconds = float(lease)
    if st.protocol == "memory" and not path.startswith("/"):
        path = "/" + path
    return st, path.rstrip("/")
