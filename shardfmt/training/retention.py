"""Which checkpoints to keep, and which staging dirs are dead. Pure decisions, no I/O.

Keep the newest ``keep_last`` committed checkpoints, plus (with ``keep_every=K``) a
checkpoint forever whenever ⌊step / K⌋ exceeds that of the last one kept that way; never
the newest one away. A staging dir (``<name>.tmp-<save_id>``) is dead once its lease —
its mtime, refreshed by the save while it runs — is older than ``lease_seconds``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

STEP_RE = re.compile(r"step_(\d{9,})")
QUARANTINE_TAG = ".corrupt-"  # step_NNNNNNNNN.corrupt-<id>: a checkpoint restore set aside (spec/ROOTS.md section 1)
DEFAULT_LEASE_SECONDS = 600.0


def step_dir_name(step: int) -> str:
    """Return the Checkpointer's directory name for ``step`` (9 digits, zero-padded)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """Return the step of a committed-checkpoint directory name, or None."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


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


def quarantine_dir_name(name: str, tag: str) -> str:
    """Return the name a quarantined checkpoint ``name`` is renamed to (no longer a step dir)."""
    return f"{name}{QUARANTINE_TAG}{tag}"


def is_quarantined_dir(name: str) -> bool:
    """Whether ``name`` is a checkpoint a restore renamed aside as unusable."""
    return QUARANTINE_TAG in name


def lease_expired(mtime: float, now: float, lease_seconds: float) -> bool:
    return now - mtime > lease_seconds
