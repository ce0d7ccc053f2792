"""Which byte store a URL names: plain paths and ``file://`` on local disk, anything else fsspec."""

from __future__ import annotations

import os

import orjson

from shardfmt.errors import StorageError
from shardfmt.io.fsspec import fsspec_storage
from shardfmt.io.local import LocalStorage
from shardfmt.io.store import Storage


def parse_storage_options(raw: str | None) -> dict | None:
    """``--storage-options`` of the command-line tools: a JSON object, or None when not given."""
    if not raw:
        return None
    try:
        opts = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"--storage-options is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise ValueError("--storage-options must be a JSON object")
    return opts


def get_storage(url: str, storage_options: dict | None = None) -> tuple[Storage, str]:
    """Return the storage for ``url`` and the path to use with it.

    Plain paths and ``file://`` URLs get ``LocalStorage``; any other URL goes to fsspec
    (``s3://`` through s3fs, configured from the standard AWS environment and
    ``storage_options``).
    """
    if not isinstance(url, (str, os.PathLike)):
        raise StorageError(f"checkpoint path must be a string or path, got {type(url).__name__}")
    url = os.fspath(url)
    if "://" not in url or url.startswith("file://"):
        local = LocalStorage()
        lease = (storage_options or {}).get("lease_seconds")
        if lease is not None:
            if not isinstance(lease, (int, float)) or lease <= 0:
                raise StorageError(f"{url}: storage option lease_seconds must be a positive number, got {lease!r}")
            local.lease_seconds = float(lease)
        return local, os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)
    return fsspec_storage(url, storage_options)
