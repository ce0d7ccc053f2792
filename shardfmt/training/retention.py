"""Which checkpoints to keep, and which staging dirs are dead. Pure decisions, no I/O.

Keep the newest ``keep_last`` committed checkpoints, plus (with ``keep_every=K``) a
checkpoint forever whenever ⌊step / K⌋ exceeds that of the last one kept that way; never
the newest one away. A staging dir (``<name>.tmp-<save_id>``) is dead once its lease —
its mtime, refreshed by the save while it runs — is older than ``lease_seconds``.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_LEASE_SECONDS = 600.0


def to_delete(steps: Sequence[int], *, keep_last: int, keep_every: int | None) -> list[int]:
    """Return the committed steps that retention removes (oldest first)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:])
    if keep_every:
        bucket = -1
        for s in ordered:
            if s // keep_every > bucket:
                keep.add(s)
                bucket = s // keep_every
    return [s for s in ordered if s not in keep]


def lease_expired(mtime: float, now: float, lease_seconds: float) -> bool:
    return now - mtime > lease_seconds
