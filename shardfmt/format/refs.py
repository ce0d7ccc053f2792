"""Incremental checkpoints: files that an earlier checkpoint of the same root holds. No I/O.

A version-2 checkpoint with the required extension ``incremental`` (spec/FORMAT.md section
4.10) may list, in a rank index, files of its *bases*: committed checkpoints that are its
siblings (same parent directory or prefix), named by their last path component. Such a
*referenced file* is named ``<base>/data/<file>`` in the index (an own file's name starts
with ``data/``) and its record is the base's record of that file plus ``keys``: the header
keys of the shards this checkpoint takes from it. A reader verifies a referenced file's bytes
against the digests copied into this checkpoint's own index, so the chain COMMITTED -> root ->
part -> rank index -> bytes vouches for them as for its own; the base's manifest is never read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardfmt.errors import ManifestError
from shardfmt.format.manifest import DATA_DIR, Extension, Manifest

EXTENSION = "incremental"
BASE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")
MAX_BASES = 4096
MAX_DEPTH = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """What the ``incremental`` extension says: the bases a checkpoint references (name ->
    the save id committed there) and ``depth``, how many incremental saves since a full one
    (1 for the first incremental save on a full checkpoint)."""

    bases: Mapping[str, str]
    depth: int

    def to_extension(self) -> Extension:
        return Extension(required=True, value={"bases": {b: {"save_id": s} for b, s in sorted(self.bases.items())},
                                               "depth": self.depth})


def check_base(name: str, where: str) -> str:
    """A base name: one path component, no ``..``, no staging name (spec section 4.10)."""
    if not isinstance(name, str) or not BASE_RE.fullmatch(name) or ".." in name or ".tmp-" in name:
        raise ManifestError(f"{where}: base {name!r} is not a checkpoint name (one path component of "
                            "[A-Za-z0-9._-], no '..', no '.tmp-')")
    return name


def parse_chain(value: Any, where: str = f"extensions[{EXTENSION!r}].value") -> Chain:
    """The ``incremental`` extension's value (already plain JSON)."""
    if not isinstance(value, dict) or set(value) != {"bases", "depth"}:
        raise ManifestError(f"{where}: expected an object with exactly 'bases' and 'depth'")
    bases, depth = value["bases"], value["depth"]
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
        raise ManifestError(f"{where}.depth: expected an integer in [1, 2^20], got {depth!r}")
    if not isinstance(bases, dict) or not 1 <= len(bases) <= MAX_BASES:
        raise ManifestError(f"{where}.bases: expected an object of 1 to {MAX_BASES} bases")
    out = {}
    for name, rec in bases.items():
        check_base(name, f"{where}.bases")
        if not isinstance(rec, dict) or set(rec) != {"save_id"} or not isinstance(rec["save_id"], str) \
                or not 1 <= len(rec["save_id"]) <= 128:
            raise ManifestError(f"{where}.bases[{name!r}]: expected {{\"save_id\": <string of 1 to 128 chars>}}")
        out[name] = rec["save_id"]
    return Chain(bases=out, depth=depth)


def chain_of(manifest: Manifest) -> Chain | None:
    """The checkpoint's chain (None: a full checkpoint, every byte its own)."""
    ext = manifest.extensions.get(EXTENSION)
    return None if ext is None else parse_chain(ext.value)


def bases_of(manifest: Manifest) -> frozenset[str]:
    chain = chain_of(manifest)
    return frozenset() if chain is None else frozenset(chain.bases)


def ref_name(base: str, name: str) -> str:
    """The index name of ``base``'s own file ``name``."""
    return f"{base}/{name}"


def split(name: str) -> tuple[str | None, str]:
    """``(base, name in the base)`` of a referenced file's name (``<base>/data/...``);
    ``(None, name)`` for any other name (an own file; a file of another tool's layout)."""
    base, sep, inner = name.partition("/")
    if sep and base != DATA_DIR and inner.startswith(DATA_DIR + "/") and BASE_RE.fullmatch(base):
        return base, inner
    return None, name


def sibling(path: str, base: str) -> str:
    """The path of checkpoint ``base`` next to the checkpoint at ``path`` (local path or URL)."""
    head, sep, _ = path.rstrip("/").rpartition("/")
    return f"{head}{sep}{base}" if sep else base


def check_chain_of(path: str, manifest: Manifest) -> None:
    """A chain never lists the checkpoint itself (section 4.10): ``path``'s own name is no base."""
    own = path.rstrip("/").rpartition("/")[2]
    if own in bases_of(manifest):
        raise ManifestError(f"{path}: its incremental chain lists the checkpoint itself ({own!r}) as a base")


def location(join: Callable[..., str], path: str, name: str) -> tuple[str, str]:
    """``(full path, checkpoint it lies in)`` of the file ``name`` of the checkpoint at ``path``:
    what a reader opens, and the ``within`` below which no link is followed (spec section 2)."""
    base, inner = split(name)
    if base is None:
        return join(path, name), path
    where = sibling(path, base)
    return join(where, inner), where


def missing_file(name: str) -> str:
    """Why a file that a committed checkpoint names is not there."""
    base, _ = split(name)
    if base is None:
        return f"{name}: missing; the checkpoint names it, so it was removed after the commit"
    return (f"{name}: missing; this incremental checkpoint takes shards from its base {base!r}, which no longer "
            "holds the file (the base was removed, moved or quarantined: a broken chain)")


__all__ = ["BASE_RE", "EXTENSION", "Chain", "bases_of", "chain_of", "check_base", "check_chain_of", "location", "missing_file", "parse_chain",
           "ref_name", "sibling", "split"]
