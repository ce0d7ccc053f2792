"""Ranged reads of one fsspec object: one GET per call, scattered into the caller's buffers.

On S3 the response body is streamed straight into the buffers (no copy of the whole range
in between), retried when it fails mid-stream, and checked against the range asked for; other
filesystems return the range as bytes, then it is scattered.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from shardfmt.errors import IntegrityError, StorageError


class RangedReader:
    """Ranged reads: one GET per call, whatever its size, scattered into the caller's buffers.

    On S3 the response body is streamed straight into the buffers (no copy of the whole
    range in between); other filesystems return the range as bytes, then it is scattered.
    """

    __slots__ = ("_st", "_path", "size")  # _st: the FsspecStorage read from

    def __init__(self, st: Any, path: str, size: int | None) -> None:
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

