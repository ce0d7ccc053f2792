"""The kill-and-resume drill's side inside a user's job (``shardfmt drill``; issue 20, item 7).

``shardfmt drill -- <command>`` runs the user's unmodified training command three times. It
tells the Checkpointers in the job what to do through the environment:

- ``SHARDFMT_DRILL_DIR``: every Checkpointer keeps its checkpoints under this directory
  instead of its own root (in ``<dir>/<the root's last name>``), so the drill's runs neither
  touch the job's real checkpoints nor resume from one another's;
- ``SHARDFMT_DRILL_KILL_AT_SAVE=K``: the highest rank SIGKILLs itself when the job asks for its
  ``K``-th save, after ``K - 1`` committed: the steps since the last checkpoint are lost, as in
  a crash between two checkpoints (torchrun then takes the whole job down).
"""

from __future__ import annotations

import os
import signal
import sys

DIR_ENV = "SHARDFMT_DRILL_DIR"
KILL_ENV = "SHARDFMT_DRILL_KILL_AT_SAVE"


def drill_root(root: str) -> str:
    """Where a Checkpointer given ``root`` keeps its checkpoints: ``root``, or under the drill's directory."""
    where = os.environ.get(DIR_ENV)
    if not where:
        return root
    name = root.rstrip("/").rpartition("/")[2] or "root"
    return os.path.join(where, name)


def drill_archive(url: str | None) -> str | None:
    """Where a Checkpointer's archive goes in a drill: under the drill's directory too (never the
    job's real archive, which a drill run would otherwise copy into and restore from)."""
    where = os.environ.get(DIR_ENV)
    if not where or not url:
        return url
    return os.path.join(where, "archive-" + (url.rstrip("/").rpartition("/")[2] or "archive"))


def kill_due(saves_asked: int, rank: int, world: int) -> bool:
    """Whether this rank is the one the drill kills, now (the job asks for save ``K``)."""
    want = os.environ.get(KILL_ENV)
    return bool(want) and saves_asked == int(want) and rank == world - 1


def die(saves_asked: int, rank: int) -> None:
    """The drill's crash: SIGKILL, without a word to the other ranks."""
    print(f"shardfmt drill: rank {rank} SIGKILLs itself at save {saves_asked}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["DIR_ENV", "KILL_ENV", "die", "drill_archive", "drill_root", "kill_due"]
