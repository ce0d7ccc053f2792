"""The names a root gives its checkpoints (spec/ROOTS.md): step directories and set-aside ones.

Pure. A committed checkpoint of a root is ``step_NNNNNNNNN`` (at least 9 digits); one a
restore set aside as unusable is renamed ``<name>.corrupt-<id>``; one newer than the step a
rollback went back to, ``<name>.rolledback-<id>``.
"""

from __future__ import annotations

import re

STEP_RE = re.compile(r"step_(\d{9,})")


QUARANTINE_TAG = ".corrupt-"  # step_NNNNNNNNN.corrupt-<id>: a checkpoint restore set aside (spec/ROOTS.md section 1)


def step_dir_name(step: int) -> str:
    """Return the Checkpointer's directory name for ``step`` (9 digits, zero-padded)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """Return the step of a committed-checkpoint directory name, or None."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


ROLLBACK_TAG = ".rolledback-"  # step_NNNNNNNNN.rolledback-<id>: newer than a rollback's step (spec/ROOTS.md section 1)


def rolled_back_dir_name(name: str, tag: str) -> str:
    """Return the name a checkpoint set aside by a rollback is renamed to (no longer a step dir)."""
    return f"{name}{ROLLBACK_TAG}{tag}"


def is_rolled_back_dir(name: str) -> bool:
    return ROLLBACK_TAG in name


def quarantine_dir_name(name: str, tag: str) -> str:
    """Return the name a quarantined checkpoint ``name`` is renamed to (no longer a step dir)."""
    return f"{name}{QUARANTINE_TAG}{tag}"


def is_quarantined_dir(name: str) -> bool:
    """Whether ``name`` is a checkpoint a restore renamed aside as unusable."""
    return QUARANTINE_TAG in name
