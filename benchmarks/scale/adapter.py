"""The interface every simulated format implements, and the blob files its sides read.

An ``Adapter`` simulates one checkpoint format's metadata path for N ranks with that
format's own functions. The driver (``cli``) calls, each in a fresh process:

    1) ``prepare(job, work)``       once per (layout, N): write what the sides read under
                                    ``work`` (the messages every rank would receive, the
                                    committed metadata, the data files' headers); not measured
    2) ``load_side(job, work, m)``  one rank's load: read + verify + parse the metadata, plan
    3) ``save_other(job, work, m)`` what a rank other than the coordinator runs on its
                                    metadata during a save (after the gather of descriptions)
    4) ``save_commit(job, work, m)`` the coordinator's commit: build, check and publish the metadata

Each side does its own set-up (reading its inputs is part of what it measures when a real
rank would do it too), calls ``m.start()`` once everything is imported, and times its steps
with ``m.phase(name)``; ``m.fact("headline", [phases])`` names the phases its table figure
sums. A format v2 adapter is one more module with these four methods, registered in
``ADAPTERS`` (``cli``).
"""

from __future__ import annotations

import abc
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import ClassVar

from benchmarks.scale.layouts import Job
from benchmarks.scale.measure import Meter

SIDES = ("load_side", "save_other", "save_commit")


class Adapter(abc.ABC):
    """One format's metadata path, simulated for a ``Job`` of N ranks."""

    name: ClassVar[str]

    @abc.abstractmethod
    def prepare(self, job: Job, work: Path) -> dict:
        """Write the sides' inputs under ``work``; return facts (e.g. ``metadata_bytes``)."""

    @abc.abstractmethod
    def load_side(self, job: Job, work: Path, meter: Meter) -> None:
        """Rank ``job.reader`` of ``job.load``: its load-side metadata work."""

    @abc.abstractmethod
    def save_other(self, job: Job, work: Path, meter: Meter) -> None:
        """A non-coordinator rank's save-side metadata work."""

    @abc.abstractmethod
    def save_commit(self, job: Job, work: Path, meter: Meter) -> None:
        """The coordinator's save-side metadata work, the commit its headline."""

    def run(self, side: str, job: Job, work: Path, meter: Meter) -> None:
        if side not in SIDES:
            raise ValueError(f"unknown side {side!r}; expected one of {SIDES}")
        getattr(self, side)(job, work, meter)


# ----------------------------------------------------------------------------- blob files

_LEN = struct.Struct("<Q")


def write_blobs(path: Path, blobs: Iterable[bytes]) -> int:
    """Write length-prefixed byte strings (one per rank's message); return the bytes written."""
    n = 0
    with open(path, "wb") as f:
        for b in blobs:
            f.write(_LEN.pack(len(b)))
            f.write(b)
            n += _LEN.size + len(b)
    return n


def read_blobs(path: Path) -> list[bytes]:
    """The byte strings ``write_blobs`` wrote, in order: what an all-gather hands every rank."""
    return list(iter_blobs(path))


def read_blob(path: Path, index: int) -> bytes:
    """The ``index``-th byte string alone (what a scatter hands one rank), skipping the others."""
    with open(path, "rb") as f:
        for _ in range(index):
            (n,) = _LEN.unpack(f.read(_LEN.size))
            f.seek(n, 1)
        (n,) = _LEN.unpack(f.read(_LEN.size))
        return f.read(n)


def iter_blobs(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while head := f.read(_LEN.size):
            (n,) = _LEN.unpack(head)
            yield f.read(n)
