"""The knobs of a save, each with its one default, and the test seams kept out of public signatures.

``SaveOptions`` owns every tuning knob of ``save`` / ``async_save`` / ``CheckpointWriter``;
the public functions take the same knobs as keywords (None: the option's value) and merge
them in with ``SaveOptions.merged``. ``Seams`` pins what a test must control to get
reproducible bytes or to interrupt a commit (save id, clock, writer versions, step hook);
it rides in the private ``_seams`` field, never in a public signature::

    opts = SaveOptions(chunk_size=4096, _seams=Seams(save_id="0123456789abcdef"))
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shardfmt.commit.protocol import StepHook
from shardfmt.errors import StateDictError
from shardfmt.format.nodepart import NodePart

Clock = Callable[[], _dt.datetime]
DEFAULT_PART_SIZE = 64 << 20  # bytes one writer thread writes and hashes at a time (a multiple of chunks)
DEFAULT_TIMEOUT = _dt.timedelta(minutes=10)  # collectives of a save, when the caller gives none
WRITE_VERSIONS = (1, 2)  # the format versions a save can write (spec/FORMAT.md section 9)


@dataclass(frozen=True, slots=True, kw_only=True)
class Seams:
    """What tests pin (None: the real thing): the save id, the clock of ``created_at``, the
    manifest's ``writer`` versions, and a hook called at every commit step (crash drills)."""

    save_id: str | None = None
    clock: Clock | None = None
    writer_versions: Mapping[str, str] | None = None
    on_step: StepHook | None = None


NO_SEAMS = Seams()


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """How a checkpoint is written (not what: the state, ``step`` and ``metadata`` are the call's).

    ``overwrite`` replaces a committed checkpoint atomically; ``storage_options`` go to fsspec;
    ``chunk_size`` is the hash chunk (None: chosen per save by ``plan.auto_chunk_size``); ``sync`` makes the files durable before the commit;
    ``timeout`` bounds every collective of a distributed save; ``mesh`` names the job's layout
    in the manifest; ``check_replicas`` turns differing replicas into an error;
    ``write_workers`` threads (None: this rank's share of the cores, at most 4) write and hash
    ``part_size`` parts of a file in parallel. ``format_version`` 2 writes what a rank of any
    job size reads in time proportional to its part (spec/FORMAT.md); 1 keeps checkpoints
    readable by readers released before version 2. ``base`` (format 2): an earlier committed
    checkpoint next to ``path``; the save writes only the shards whose bytes differ from it and
    references the others (an incremental checkpoint, spec/FORMAT.md section 4.10).
    ``node_part`` (format 2, local disk): ``path`` is on this node's own disk and the save
    leaves each node its share of the checkpoint, committed by ``NODE_PART`` (the node-local
    tier: ``commit.nodepart``; the Checkpointer's ``local=`` sets it).
    """

    overwrite: bool = False
    storage_options: Mapping | None = None
    chunk_size: int | None = None
    sync: bool = True
    timeout: _dt.timedelta | None = None
    mesh: Mapping[str, int] | None = None
    check_replicas: bool = False
    write_workers: int | None = None
    part_size: int = DEFAULT_PART_SIZE
    format_version: int = 2
    base: str | None = None
    node_part: NodePart | None = None
    _seams: Seams = field(default=NO_SEAMS, repr=False)

    @classmethod
    def merged(cls, options: SaveOptions | None = None, **given) -> SaveOptions:
        """``options`` (default: the defaults) with every knob given as a keyword that is not None."""
        base = options if options is not None else cls()
        changes = {k: v for k, v in given.items() if v is not None}
        return dataclasses.replace(base, **changes) if changes else base

    def __post_init__(self) -> None:
        if self.format_version not in WRITE_VERSIONS:
            raise StateDictError(f"format_version must be one of {list(WRITE_VERSIONS)}, got {self.format_version!r}")
        if self.base is not None and self.format_version < 2:
            raise StateDictError("base= (an incremental save) needs format_version 2")
        if self.node_part is not None and (self.format_version < 2 or self.base is not None):
            raise StateDictError("a save on the node-local tier needs format_version 2 and no base= (not incremental)")

    @property
    def seams(self) -> Seams:
        return self._seams


__all__ = ["DEFAULT_PART_SIZE", "DEFAULT_TIMEOUT", "Clock", "NO_SEAMS", "SaveOptions", "Seams"]
