"""The Checkpointer's knobs, each with its one default, checked once when the options are made.

``Checkpointer(root, keep_last=5, archive="s3://b/arch")`` and
``Checkpointer(root, options=CheckpointerOptions(retention=RetentionPolicy(keep_last=5),
archive=ArchivePolicy(url="s3://b/arch")))`` are the same: the flat keywords name the nested
fields (``archive_every`` is ``archive.every``; the table is ``KEYWORDS``). Errors name the flat
keyword, the one a caller of ``Checkpointer(...)`` typed. Per-call knobs (``save``'s ``async_``,
``policy``, ``stage``; ``restore``'s ``allow_mismatch``) stay on the calls.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
from collections.abc import Mapping
from typing import Any


def _check_count(name: str, v: Any, *, none_ok: bool = False) -> None:
    if not (v is None and none_ok) and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"Checkpointer: {name} must be an int >= 1{' or None' if none_ok else ''}, got {v!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """Keep the newest ``keep_last`` committed checkpoints, plus one per ``keep_every`` steps forever."""

    keep_last: int = 3
    keep_every: int | None = None

    def __post_init__(self) -> None:
        _check_count("keep_last", self.keep_last)
        _check_count("keep_every", self.keep_every, none_ok=True)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ArchivePolicy:
    """Copy a committed checkpoint to ``url`` whenever ⌊step / every⌋ is new (no ``url``: no archive).

    A failed copy is tried ``attempts`` times in all, waiting ``backoff`` seconds, doubled each
    time, between tries.
    """

    url: str | None = None
    every: int = 1
    storage_options: dict | None = None
    attempts: int = 4
    backoff: float = 2.0

    def __post_init__(self) -> None:
        _check_count("archive_every", self.every)
        _check_count("archive_attempts", self.attempts)
        b = self.backoff
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < float("inf"):
            raise ValueError(f"Checkpointer: archive_backoff must be a finite number >= 0, got {b!r}")


REPLICATE_POLICIES = ("skip", "wait")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalTierPolicy:
    """Save on each node's own disk first, then copy to the root in the background (no ``url``:
    save to the root directly; ``training.tiers``).

    ``url`` is a local path, the same on every node (``{node}`` in it becomes the node's name:
    nodes that share one filesystem, or a test); ``node`` names this process's node (None:
    ``$SHARDFMT_NODE``, else the host name). Each node keeps its ``keep`` newest parts.
    ``replicate`` says what a save does while an earlier save's copy is still running on any
    node: "skip" leaves this save on the local tier only (logged), "wait" blocks the save
    until that copy finished (logged, with the seconds waited).
    """

    url: str | None = None
    node: str | None = None
    keep: int = 2
    replicate: str = "skip"

    def __post_init__(self) -> None:
        _check_count("local_keep", self.keep)
        if self.replicate not in REPLICATE_POLICIES:
            raise ValueError(f"Checkpointer: replicate must be one of {', '.join(REPLICATE_POLICIES)}, "
                             f"got {self.replicate!r}")
        if self.url is not None and (not isinstance(self.url, str) or ("://" in self.url
                                                                        and not self.url.startswith("file://"))):
            raise ValueError(f"Checkpointer: local= must be a local directory (each node's own disk), got {self.url!r}")
        if self.node is not None and (not isinstance(self.node, str) or not self.node or "/" in self.node):
            raise ValueError(f"Checkpointer: node must be a non-empty name without '/', got {self.node!r}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointerOptions:
    """Everything a Checkpointer is built with besides its root.

    ``config`` is compared with the checkpoint's at restore; ``allow_fresh_start`` lets restore
    (and a root whose parent is missing) start from scratch; ``lease_seconds`` is the saves'
    heartbeat and the collector's judgement of a dead save; ``process_group``, ``timeout`` and
    ``mesh`` are passed to ``save``/``load``. ``incremental`` makes each save after the first of
    a run write only the shards whose bytes changed since this Checkpointer's previous save and
    reference the rest there (spec/FORMAT.md section 4.10); every ``full_every``-th save is full,
    which bounds the chain a restore depends on. ``every`` (an int: steps; "auto": the interval
    ``suggest_interval`` gives from the measured cost and ``mtbf``, the mean seconds between
    failures, and ``restart_cost``) is what ``maybe_save`` applies. ``data_fingerprint`` (any
    typed JSON: a digest of the data's file list, a dataset version) is saved, and a restore into
    a job whose fingerprint differs is refused (as for each data entry's length or version).
    ``save_grads`` saves the models' set gradients with each checkpoint and restores them (or
    clears them, where the checkpoint holds none): a save in the middle of a gradient
    accumulation then resumes exactly (``training.grads``).
    """

    retention: RetentionPolicy = dataclasses.field(default_factory=RetentionPolicy)
    archive: ArchivePolicy = dataclasses.field(default_factory=ArchivePolicy)
    local: LocalTierPolicy = dataclasses.field(default_factory=LocalTierPolicy)
    config: Any = None
    allow_fresh_start: bool = False
    storage_options: dict | None = None
    process_group: Any = None
    timeout: _dt.timedelta | None = None
    lease_seconds: float | None = None
    mesh: Mapping[str, int] | None = None
    incremental: bool = False
    full_every: int = 8
    every: int | str | None = None
    mtbf: float | None = None
    restart_cost: float | None = None
    data_fingerprint: Any = None
    save_grads: bool = False

    def __post_init__(self) -> None:
        if self.every is not None and self.every != "auto":
            _check_count("every", self.every)
        for name in ("mtbf", "restart_cost"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf")
                                  or (name == "mtbf" and v == 0)):
                raise ValueError(f"Checkpointer: {name} must be a finite number of seconds (> 0 for mtbf), got {v!r}")
        if self.every == "auto" and self.mtbf is None:
            raise ValueError("Checkpointer: every='auto' needs mtbf= (the mean time between failures, in seconds)")
        if not isinstance(self.incremental, bool):
            raise ValueError(f"Checkpointer: incremental must be True or False, got {self.incremental!r}")
        _check_count("full_every", self.full_every)
        if self.incremental and self.local.url is not None:
            raise ValueError("Checkpointer: incremental=True with local= is not supported (a node-local save is "
                             "always full)")
        if self.full_every > 4096:  # a chain names at most 4096 bases (spec/FORMAT.md section 4.10)
            raise ValueError(f"Checkpointer: full_every must be at most 4096, got {self.full_every}")

    def with_keywords(self, **keywords: Any) -> CheckpointerOptions:
        """Return these options with the Checkpointer's flat ``keywords`` (``KEYWORDS``) set."""
        unknown = sorted(set(keywords) - set(KEYWORDS))
        if unknown:
            raise TypeError(f"Checkpointer() got unexpected keyword argument(s): {', '.join(unknown)}")
        nested: dict[str, dict[str, Any]] = {"retention": {}, "archive": {}, "local": {}, "": {}}
        for name, value in keywords.items():
            part, field = KEYWORDS[name]
            nested[part][field] = value
        return dataclasses.replace(
            self, retention=dataclasses.replace(self.retention, **nested["retention"]),
            archive=dataclasses.replace(self.archive, **nested["archive"]),
            local=dataclasses.replace(self.local, **nested["local"]), **nested[""])

    @property
    def effective_storage_options(self) -> dict | None:
        """``storage_options`` with ``lease_seconds`` in them when set (the saves and the collector agree)."""
        if self.lease_seconds is None:
            return self.storage_options
        return dict(self.storage_options or {}, lease_seconds=self.lease_seconds)


# Checkpointer(...) keyword -> (part of CheckpointerOptions, its field); "" is the options itself
KEYWORDS: dict[str, tuple[str, str]] = {
    "keep_last": ("retention", "keep_last"),
    "keep_every": ("retention", "keep_every"),
    "archive": ("archive", "url"),
    "archive_every": ("archive", "every"),
    "archive_storage_options": ("archive", "storage_options"),
    "archive_attempts": ("archive", "attempts"),
    "archive_backoff": ("archive", "backoff"),
    "local": ("local", "url"),
    "node": ("local", "node"),
    "local_keep": ("local", "keep"),
    "replicate": ("local", "replicate"),
    **{f.name: ("", f.name) for f in dataclasses.fields(CheckpointerOptions)
       if f.name not in ("retention", "archive", "local")},
}
