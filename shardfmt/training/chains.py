"""What incremental checkpoints need kept: the closure of their bases (spec/ROOTS.md section 1).

A committed incremental checkpoint lists its bases in its root manifest (spec/FORMAT.md
section 4.10); a save still running names its base in its staging location (``BASES``) for as
long as its lease is fresh. Retention removes no checkpoint that a kept checkpoint or a live
save needs, directly or through a base's own bases.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import orjson

from shardfmt.commit.protocol import commit_strategy
from shardfmt.errors import ShardfmtError, StorageError
from shardfmt.format import refs
from shardfmt.format.manifest import BASES_NAME
from shardfmt.io.store import Storage
from shardfmt.loading.reader import open_checkpoint
from shardfmt.training.retention import lease_expired


def bases_of_checkpoint(storage: Storage, path: str) -> frozenset[str]:
    """The bases the committed checkpoint at ``path`` lists: none when it is gone or is no
    readable checkpoint (nothing could load it). A storage failure (a timeout, throttling, a
    refused permission) says nothing about it and is raised: the caller removes nothing."""
    try:
        return refs.bases_of(open_checkpoint(path, storage=storage, whole=False).manifest)
    except StorageError:
        raise
    except (ShardfmtError, OSError):
        return frozenset()


def live_bases(storage: Storage, root: str, *, lease_seconds: float | None = None,
               now: float | None = None) -> frozenset[str]:
    """The bases named by the saves under ``root`` whose lease is fresh (a storage failure is
    raised: the caller removes nothing)."""
    lease = storage.lease_seconds if lease_seconds is None else lease_seconds
    now = time.time() if now is None else now
    strategy = commit_strategy(storage)
    out: set[str] = set()
    for name in storage.listdir(root):
        if not strategy.may_be_leftover(name):
            continue
        path = storage.join(root, name)
        try:
            if strategy.leftover_state(root, name) != "leftover" or \
                    lease_expired(strategy.lease_time(path), now, lease):
                continue
            raw = storage.read_bytes(storage.join(path, BASES_NAME), limit=1 << 16, within=path)
            out.update(refs.check_base(b, f"{name}/{BASES_NAME}") for b in orjson.loads(raw)["bases"])
        except StorageError:
            raise  # it says nothing about the save: the caller removes nothing
        except (ShardfmtError, OSError, ValueError, KeyError, TypeError):
            continue  # no BASES (a full save), or not a save's: nothing to protect
    return frozenset(out)


def needed(storage: Storage, root: str, kept: Iterable[str], live: Iterable[str] = ()) -> frozenset[str]:
    """The names under ``root`` that the checkpoints ``kept`` (paths) and the live saves' bases
    ``live`` (names) need: their bases, and their bases' bases."""
    found: set[str] = set(live)
    for path in kept:
        found |= bases_of_checkpoint(storage, path)
    frontier = list(found)
    while frontier:
        name = frontier.pop()
        for b in bases_of_checkpoint(storage, storage.join(root, name)) - found:
            found.add(b)
            frontier.append(b)
    return frozenset(found)


__all__ = ["bases_of_checkpoint", "live_bases", "needed"]
