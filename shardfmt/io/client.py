"""The fsspec client's defaults and failures: what every fsspec-backed module shares.

A missing bucket, refused credentials, an unreachable endpoint or a server error become one
``StorageError`` naming the URL and the cause (``translate_error``); the S3 client is given
timeouts and bounded retries (``S3_CONFIG_DEFAULTS``), so nothing hangs.
"""

from __future__ import annotations

from shardfmt.errors import (
    AccessDeniedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
)

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



def info_time(info: dict) -> float:
    """The modification time in an fsspec ``info`` record (S3: LastModified), 0.0 when it has none."""
    t = info.get("LastModified") or info.get("mtime") or info.get("created")
    if t is None:
        return 0.0
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


