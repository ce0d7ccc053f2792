"""Node parts: each node's share of a checkpoint saved on the node-local tier (spec/ROOTS.md section 3).

On the node-local tier every node has a disk of its own and a checkpoint's files are spread
over those disks: a node holds the data files and rank indexes its own ranks wrote, plus the
root manifest and the rank table (the same bytes on every node). No node holds the whole
checkpoint, so none says ``COMMITTED``; a node commits its share with ``NODE_PART``::

    1) the node's leader (its lowest rank) makes ``<step>.tmp-<save id>/`` on its disk, the
       name rank 0's staging has on node 0; every rank of the node writes its files there
    2) once every rank has written, the root manifest and the rank table are written there
       (rank 0's bytes, broadcast to the leaders)
    3) ``NODE_PART`` is written: the ``COMMITTED`` record the whole checkpoint would have (save
       id, manifest digest, format version), which node this is (``index`` of ``count``, its
       ``ranks``) and the world size; then the staging dir is fsynced
    4) the staging dir is renamed to ``<step>`` (the commit point of the node's part); a part
       of the same step already there (an abandoned run's) is moved aside and removed after

The checkpoint is complete on the tier only when every node of its save holds its part with
the same save id: only the ranks together can tell (``training.tiers``). A crash leaves each
node's part absent or whole; a missing part makes the step unusable on the tier, never torn.
"""

from __future__ import annotations

import posixpath
import uuid

from shardfmt.commit.names import parse_step_dir
from shardfmt.commit.rename import staging_path
from shardfmt.errors import CheckpointNotFoundError, CommitError, IntegrityError
from shardfmt.format import hashing
from shardfmt.format.manifest import DATA_DIR, INDEX_DIR, MANIFEST_NAME
from shardfmt.format.nodepart import (
    MAX_PART_BYTES,
    NODE_PART_NAME,
    NodePart,
    PartRecord,
    commit_record,
)
from shardfmt.io.local import LocalStorage

__all__ = ["NODE_PART_NAME", "NodePart", "PartRecord", "commit_record", "is_part", "list_parts", "local_staging",
           "publish_part", "read_part", "stage_part"]

def local_staging(path: str, staging: str) -> str:
    """This node's staging dir for ``path``: rank 0's staging name beside this node's ``path``."""
    return posixpath.join(posixpath.dirname(path.rstrip("/")), posixpath.basename(staging.rstrip("/")))


def stage_part(storage: LocalStorage, path: str, save_id: str) -> str:
    """1) Make this node's staging dir for the save ``save_id`` at ``path``; return it."""
    target = staging_path(path, save_id)
    if storage.exists(target):
        raise CommitError(f"{target}: another node staged this save here too: is the node-local tier a filesystem "
                          "the nodes share? Give each node a directory of its own ({node} in local=), and the "
                          "ranks of one machine one node name")
    storage.makedirs(storage.join(target, DATA_DIR))
    storage.makedirs(storage.join(target, INDEX_DIR))
    return target


def publish_part(storage: LocalStorage, path: str, staging: str, manifest_bytes: bytes, record: PartRecord,
                 tables: dict[str, bytes]) -> None:
    """2)-4) Write the root manifest, the rank table's parts (``tables``: name -> bytes) and
    ``NODE_PART`` into ``staging``, then rename it to ``path``."""
    if record.commit.manifest_digest != hashing.digest_bytes(manifest_bytes):
        raise IntegrityError(f"{path}: the manifest does not hash to its record's digest")
    for name, raw in sorted(tables.items()):
        storage.write_bytes(storage.join(staging, name), raw)
    storage.write_bytes(storage.join(staging, MANIFEST_NAME), manifest_bytes)
    storage.write_bytes(storage.join(staging, NODE_PART_NAME), record.to_json())
    for sub in (DATA_DIR, INDEX_DIR):
        if storage.isdir(storage.join(staging, sub)):
            storage.sync_dir(storage.join(staging, sub))
    storage.sync_dir(staging)
    old = None
    if storage.exists(path):  # an abandoned run's part of this step (a restore went back before it)
        old = f"{path}.old-{uuid.uuid4().hex[:16]}"
        storage.rename(path, old)
    storage.rename(staging, path)
    storage.sync_dir(posixpath.dirname(path.rstrip("/")) or ".")
    if old is not None:
        storage.remove_tree(old)


def read_part(storage: LocalStorage, path: str) -> PartRecord:
    """The ``NODE_PART`` record of the node part at ``path``; CheckpointNotFoundError when none."""
    marker = storage.join(path, NODE_PART_NAME)
    raw = storage.read_bytes(marker, limit=MAX_PART_BYTES, within=path)
    return PartRecord.parse(raw, source=storage.url(marker))


def is_part(storage: LocalStorage, path: str) -> bool:
    return storage.exists(storage.join(path, NODE_PART_NAME))


def list_parts(storage: LocalStorage, root: str) -> list[tuple[int, str, PartRecord]]:
    """Every committed node part under ``root``, oldest step first; an unreadable record is skipped."""
    if not storage.isdir(root):
        return []
    out = []
    for name in storage.listdir(root):
        step = parse_step_dir(name)
        if step is None:
            continue
        path = storage.join(root, name)
        try:
            out.append((step, path, read_part(storage, path)))
        except (CheckpointNotFoundError, IntegrityError):
            continue
    return sorted(out, key=lambda t: t[0])
