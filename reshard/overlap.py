"""Refuse a destination that is the source, holds it or lies inside it (every tool checks first)."""

from __future__ import annotations

import os
from pathlib import PurePath

from reshard._shardfmt import Storage, get_storage
from reshard.errors import OverlapError


def refuse_overlap(storage: Storage, path: str, dst: str, storage_options: dict | None) -> None:
    """Raise OverlapError when ``dst`` is the source at ``path`` on ``storage``, a directory
    holding it (a checkpoint root holding it as a step) or a path inside it: replacing ``dst``
    (``overwrite``) would delete the source. Local paths are compared resolved (symlinks,
    ``..``); URLs by protocol and path."""
    dst_storage, dst_path = get_storage(dst, storage_options)
    src_loc, dst_loc = _location(storage, path), _location(dst_storage, dst_path)
    n = min(len(src_loc), len(dst_loc))
    if src_loc[:n] != dst_loc[:n]:
        return
    src = storage.url(path)
    if len(dst_loc) == len(src_loc):
        raise OverlapError(f"{dst}: the destination is the source {src}; write to a new path")
    if len(dst_loc) < len(src_loc):
        raise OverlapError(f"{dst}: the destination holds the source {src} (replacing it would delete the "
                           "source); write to a new path")
    raise OverlapError(f"{dst}: the destination lies inside the source {src}; write to a path outside it")


def _location(storage: Storage, path: str) -> tuple[str, ...]:
    """Where ``path`` is, as comparable parts: ("file", resolved local path parts...) or
    (protocol, bucket, key parts...)."""
    url = storage.url(path)
    if "://" not in url:  # LocalStorage, fsspec's local filesystem: a path, not a URL
        return ("file", *PurePath(os.path.realpath(path)).parts)
    protocol, _, rest = url.partition("://")
    return (protocol, *(p for p in rest.split("/") if p))


__all__ = ["OverlapError", "refuse_overlap"]
