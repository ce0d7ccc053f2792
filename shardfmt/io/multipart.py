"""Writers of fsspec objects: streaming multipart uploads on S3, the filesystem's own file elsewhere.

``MultipartWriter`` streams a data file up in ``part_size`` parts, ``write_concurrency`` at a
time; at most ``write_concurrency + 1`` parts are ever in memory, never the whole file. An
upload that fails is aborted, so it leaves no parts behind.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from shardfmt.errors import StorageError
from shardfmt.format.tensor_bytes import BufferFile
from shardfmt.io.client import translate_error

_PARTS_PER_SIZE_STEP = 2000   # part size doubles every 2000 parts: S3 allows 10,000 per upload


class StreamWriter:
    """Generic fsspec: the filesystem's own buffered file."""

    __slots__ = ("_st", "_f", "_path")

    def __init__(self, st: Any, path: str) -> None:
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


class MultipartWriter:
    """S3: stream a file up as a multipart upload, parts in parallel, memory bounded.

    Bytes fill one ``part_size`` buffer; a full buffer is handed to an upload thread and a
    fresh one started. At most ``concurrency`` uploads run at once (``write`` blocks for a free
    slot), so at most ``concurrency + 1`` part buffers exist. A file smaller than one part is
    a single PUT. Any failure aborts the upload: S3 keeps nothing of it.
    """

    def __init__(self, st: Any, path: str, part_size: int, concurrency: int) -> None:
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

