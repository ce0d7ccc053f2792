"""Byte stores on fsspec filesystems, object stores (S3 through s3fs) first.

What ``FsspecStorage`` adds over plain fsspec:

- **Errors that say what happened** (``io.client.translate_error``): every client failure
  becomes one typed error naming the URL and the cause; timeouts and bounded retries, so
  nothing hangs.
- **Ranged reads** of exactly the bytes asked for (``io.ranged``: one GET each), and a larger
  ``max_gap`` than local disk: on S3 a request costs a round trip, worth megabytes of transfer.
- **Streaming multipart uploads** on S3 (``io.multipart``): memory bounded, aborted on failure.
- On fsspec's local filesystem, reads, listings and removals as ``LocalStorage`` does them
  (only regular files; under a checkpoint through no symbolic link: spec section 2).

No commit policy: object stores cannot rename, so saves here commit with the COMMITTED
object written last and keep a LEASE object fresh (``commit.marker``). Every request is
counted in ``storage.stats``.
"""

from __future__ import annotations

import os
import posixpath
from typing import Any

from shardfmt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IntegrityError,
    ShardfmtError,
    StorageError,
)
from shardfmt.io.client import (
    OBJECT_STORE_LEASE_SECONDS,
    OBJECT_STORE_PROTOCOLS,
    S3_CONFIG_DEFAULTS,
    S3_MAX_GAP,
    S3_PART_SIZE,
    S3_READ_CONCURRENCY,
    S3_WRITE_CONCURRENCY,
    info_time,
    translate_error,
)
from shardfmt.io.local import LOCAL_MAX_GAP, LocalStorage
from shardfmt.io.multipart import MultipartWriter, StreamWriter
from shardfmt.io.ranged import RangedReader
from shardfmt.io.store import PROCESS_IO, FileReader, IOStats


class FsspecStorage:
    """Any fsspec filesystem as a byte store. No atomic rename: saves here commit with the
    marker strategy (``commit.marker``: the COMMITTED object, written last).

    On fsspec's local filesystem (``local://``, and filesystems built on it) files are read,
    listed and removed as ``LocalStorage`` does: only regular files, opened without blocking
    and, under a checkpoint, through no symbolic link (spec section 2).
    """

    def __init__(self, fs: Any, *, protocol: str | None = None, part_size: int = S3_PART_SIZE,
                 write_concurrency: int = S3_WRITE_CONCURRENCY) -> None:
        self.fs = fs
        self.stats = IOStats(parent=PROCESS_IO)
        proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.protocol = protocol or proto
        self.remote = self.protocol in OBJECT_STORE_PROTOCOLS
        self.multipart = hasattr(fs, "call_s3")
        self.max_gap = S3_MAX_GAP if self.remote else LOCAL_MAX_GAP
        self.read_concurrency = S3_READ_CONCURRENCY if self.remote else (os.cpu_count() or 1)
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
            return MultipartWriter(self, path, self.part_size, self.write_concurrency)
        return StreamWriter(self, path)

    def open_reader(self, path: str, size: int | None = None, *, within: str | None = None) -> FileReader:
        if self._disk is not None:
            return self._disk.open_reader(path, within=within)
        return RangedReader(self, path, size)

    def makedirs(self, path: str) -> None:
        if self.remote:
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
            elif not self.remote:  # real directories: remove them too, deepest first
                dirs = [d for d, info in self.fs.find(path, withdirs=True, detail=True).items()
                        if info.get("type") == "directory"]
                for d in sorted(dirs, key=lambda d: -d.count("/")) + ([path] if self.fs.isdir(path) else []):
                    self.fs.rmdir(d)
        except FileNotFoundError:
            pass
        except Exception as e:  # noqa: BLE001
            raise translate_error(self.url(path), e, "remove") from None
        self.fs.invalidate_cache(path)

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

    # -- what the marker commit strategy (commit.marker) asks of an object store, outside the byte store
    def object_time(self, path: str) -> float:
        """When the object ``path`` was last written (one request); CheckpointNotFoundError when absent."""
        try:
            return info_time(self.fs.info(path))
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.url(path)}: does not exist") from None
        except Exception as e:  # noqa: BLE001
            raise translate_error(self.url(path), e, "stat") from None

    def newest_time(self, path: str) -> float:
        """The newest LastModified of the object ``path``, or of the objects under the prefix ``path``."""
        try:
            infos = list(self.fs.find(path, detail=True).values()) if self.fs.isdir(path) else [self.fs.info(path)]
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{self.url(path)}: does not exist") from None
        except Exception as e:  # noqa: BLE001
            raise translate_error(self.url(path), e, "stat") from None
        return max((info_time(i) for i in infos), default=0.0)

    def discard(self, path: str) -> None:
        """Remove the object ``path`` if it is there (one request, best effort)."""
        try:
            self.fs.rm_file(path)
        except Exception:  # noqa: BLE001
            pass

    def list_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """Multipart uploads begun and never completed under ``prefix``: (path, upload id, start time)."""
        if not self.multipart:
            return []
        bucket, key, _ = self.fs.split_path(prefix)
        out = self._call(prefix, "list multipart uploads", self.fs.call_s3, "list_multipart_uploads",
                         Bucket=bucket, Prefix=key.rstrip("/") + "/" if key else "")
        return [(f"{bucket}/{u['Key']}", u["UploadId"], info_time({"LastModified": u.get("Initiated")}))
                for u in out.get("Uploads", [])]

    def abort_upload(self, path: str, upload_id: str) -> None:
        bucket, key, _ = self.fs.split_path(path)
        self._call(path, "abort multipart upload", self.fs.call_s3, "abort_multipart_upload",
                   Bucket=bucket, Key=key, UploadId=upload_id)



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
