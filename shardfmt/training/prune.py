"""The retention pass: after a save commits, remove the checkpoints ``retention.to_delete`` names.

The newest ``keep_last`` committed checkpoints are checked in full (a torn one does not count);
older ones by their markers alone, so a pass costs the same with 10 or 10,000 checkpoints kept
(``keep_every``). Before a checkpoint stays as its ``keep_every`` bucket's long-term copy, or goes,
it is checked in full (once): the copy that stays must be readable, and a checkpoint of a format
version this reader cannot read (a newer release's) is neither counted nor removed
(spec/ROOTS.md section 1). A checkpoint being copied to the archive is left for a later pass, and so is the base of an
incremental checkpoint that stays, of one a rollback set aside (kept, not deleted), or of a
save still running (``chains``): retention never breaks a chain (spec/ROOTS.md section 1).
"""

from __future__ import annotations

from collections.abc import Callable

from shardfmt.commit.names import is_rolled_back_dir
from shardfmt.io.store import Storage
from shardfmt.training.chains import live_bases, needed
from shardfmt.training.options import RetentionPolicy
from shardfmt.training.retention import to_delete
from shardfmt.training.roots import checkpoint_status, step_paths


def prune(storage: Storage, root: str, policy: RetentionPolicy, *, busy: Callable[[str], bool],
          lease_seconds: float | None = None) -> None:
    """Remove the committed checkpoints under ``root`` that ``policy`` does not keep, except where
    ``busy(path)`` (being archived) and the bases that kept checkpoints and live saves (their
    lease fresh by ``lease_seconds``) still need (``chains``)."""
    committed, full, aside = _committed(storage, root, policy.keep_last)

    def status_of(s: int) -> str:
        if s not in full:
            full[s] = checkpoint_status(storage, committed[s])[0]
        return full[s]

    while True:
        # Checked in full (once) before they stay or go: the copy that stays for a bucket being
        # pruned must be readable, and a checkpoint of a format version this reader cannot read
        # (a newer release's) is neither counted nor removed (spec/ROOTS.md section 1).
        doomed = to_delete(list(committed), keep_last=policy.keep_last, keep_every=policy.keep_every)
        pruned = {s // policy.keep_every for s in doomed} if policy.keep_every else set()
        stays = [s for s in committed if s not in doomed and s // policy.keep_every in pruned] if pruned else []
        drop = ([s for s in stays if status_of(s) != "committed"]  # torn: neither kept as the
                + [s for s in doomed if status_of(s) == "unsupported"])  # bucket's copy nor removed
        if not drop:
            break
        for s in drop:
            del committed[s]
    if doomed:  # incremental checkpoints: never a base that a kept, busy or live save needs
        # (bases are older steps: kept checkpoints older than every doomed one need none of them)
        kept = [p for s, p in committed.items() if (s not in doomed or busy(p)) and s > min(doomed)] + aside
        need = needed(storage, root, kept, live_bases(storage, root, lease_seconds=lease_seconds))
        doomed = [s for s in doomed if _name(committed[s]) not in need]
    for step in doomed:
        if busy(committed[step]):
            continue  # being copied to the archive: removed by a later retention pass
        storage.remove_tree(committed[step])


def _name(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2]


def _committed(storage: Storage, root: str, keep_last: int) -> tuple[dict[int, str], dict[int, str], list[str]]:
    """Return (committed step -> path, step -> status for those checked in full, the paths of
    checkpoints a rollback set aside), newest first."""
    committed: dict[int, str] = {}
    full: dict[int, str] = {}  # step -> its status, checked in full
    aside = [storage.join(root, n) for n in storage.listdir(root) if is_rolled_back_dir(n)]  # renamed
    for step, path in reversed(step_paths(storage, root)):
        if len(committed) < keep_last:
            status = full[step] = checkpoint_status(storage, path)[0]
        else:
            status = checkpoint_status(storage, path, markers_only=True)[0]
        if status == "committed":
            committed[step] = path
        elif status == "rolled_back":  # marked in place (object stores)
            aside.append(path)
    return committed, full, aside
