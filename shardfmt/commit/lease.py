"""Lease records of saves on object stores: who holds ``<path>/LEASE`` and whether it still runs.

A save in progress keeps its LEASE object fresh (its LastModified is the lease time);
collectors use it to tell a dead save from a live one (spec/ROOTS.md section 1). The record
names the save and the process holding it: host, pid namespace and pid.
"""

from __future__ import annotations

import os
import time

import orjson

from shardfmt.errors import CheckpointNotFoundError, IntegrityError, ShardfmtError
from shardfmt.format.manifest import LEASE_NAME
from shardfmt.io.store import ByteStore


def lease_identity() -> dict:
    """Who holds a lease: host, pid namespace and pid (a pid means something only within both)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"host": os.uname().nodename, "pidns": pidns, "pid": os.getpid()}


def lease_record(owner: str) -> bytes:
    """The LEASE object's bytes for save ``owner``, taken or refreshed now."""
    return orjson.dumps(dict(lease_identity(), time=time.time(), save_id=owner))


def read_lease(storage: ByteStore, path: str) -> dict:
    """The LEASE object under ``path`` as a dict ({} when unreadable); CheckpointNotFoundError
    when there is none."""
    try:
        info = orjson.loads(storage.read_bytes(storage.join(path, LEASE_NAME), limit=4096, within=path))
    except (ValueError, IntegrityError):
        return {}
    return info if isinstance(info, dict) else {}


def lease_owner(storage: ByteStore, path: str) -> str | None:
    """The save id in the LEASE under ``path`` ("" for a lease that names none), or None when
    there is no lease."""
    try:
        return str(read_lease(storage, path).get("save_id") or "")
    except CheckpointNotFoundError:
        return None


def holder_is_dead(storage: ByteStore, path: str) -> bool:
    """Whether the lease at ``path`` was taken by a process of this host (same hostname and
    pid namespace) that no longer runs: a job restarted on the same node need not wait out
    its dead predecessor's lease."""
    try:
        holder = read_lease(storage, path)
        me = lease_identity()
        if not isinstance(holder.get("pid"), int) \
                or any(holder.get(k) != me[k] for k in ("host", "pidns")):
            return False
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except (ShardfmtError, OSError, ValueError, AttributeError):
        return False
    return False
