"""A save on the node-local tier: every node stages on its own disk and commits its own part.

The protocol's steps (``protocol``) run as for any save, with two more collectives
(``commit.nodepart`` says what a node part is)::

    5) rank 0 stages on node 0 as any save does; the leader of every other node then makes
       the staging dir of the same name on its own disk (``stage_nodes``); the ranks learn
       whether every node did, and each writes its files into its own node's staging dir
    7) rank 0 builds the manifest and commits node 0's part (``CheckpointWriter`` with a
       ``node_part``); the broadcast that tells every rank carries the manifest's bytes and
       the rank table's; every other leader writes them and commits its node's part
       (``commit_nodes``). If any node failed, every leader removes its part again and every
       rank raises: a save is on the tier on every node of the job, or on none.
"""

from __future__ import annotations

from shardfmt.commit import protocol as _commit
from shardfmt.commit.nodepart import (
    NodePart,
    PartRecord,
    commit_record,
    local_staging,
    publish_part,
    stage_part,
)
from shardfmt.errors import ShardfmtError
from shardfmt.format.manifest import Manifest
from shardfmt.saving.coordinator import Coordinator
from shardfmt.saving.messages import Committed, Done, RankError, Staged


def stage_nodes(coord: Coordinator, storage, path: str, staged: Staged, part: NodePart
                ) -> tuple[Staged, _commit.Heartbeat | None]:
    """5) Every node's leader (node 0's is rank 0, which staged already) stages ``path`` on its
    own disk under rank 0's staging name, and keeps its lease fresh (a collector on the node
    leaves it alone) until ``commit_nodes`` or ``abort_node``; return where this rank's node
    stages, and the leader's heartbeat."""
    mine = local_staging(path, staged.staging)
    msg: Done | RankError = Done()
    lease = None
    if part.leads(coord.rank) and part.index != 0:
        try:
            stage_part(storage, path, staged.save_id)
            lease = _commit.Heartbeat(storage, mine, storage.lease_seconds, staged.save_id)
        except (ShardfmtError, OSError) as e:
            msg = RankError.of(coord.rank, e)
    try:
        outcomes = coord.gather(msg, Done.from_json, "staging on every node")
    except BaseException:  # a dead or frozen rank: this node's staging goes, its heartbeat stops
        abort_node(coord, storage, mine, part, lease)
        raise
    if any(isinstance(o, RankError) for o in outcomes):
        abort_node(coord, storage, mine, part, lease)
        coord.raise_failures(outcomes, "staging on every node")
    return Staged(save_id=staged.save_id, staging=mine, name_tag=staged.name_tag), lease


def abort_node(coord: Coordinator, storage, staging: str, part: NodePart, lease: _commit.Heartbeat | None) -> None:
    """A failed save: every other node's leader removes its staging dir (rank 0's writer removes node 0's)."""
    if lease is not None:
        lease.stop()
    if part.leads(coord.rank) and part.index != 0:
        _commit.abort(storage, staging)


def tables_of(storage, path: str, manifest: Manifest) -> tuple[tuple[str, str], ...]:
    """Rank 0, node 0's part committed: the rank table's parts as every other node's part gets them."""
    return tuple((p.name, storage.read_bytes(storage.join(path, p.name), limit=p.size, within=path).decode())
                 for p in manifest.ranks)


def commit_nodes(coord: Coordinator, storage, path: str, staged: Staged, part: NodePart, outcome: Committed,
                 lease: _commit.Heartbeat | None) -> None:
    """7) Every other node's leader commits its part with rank 0's bytes; all agree on the outcome."""
    msg: Done | RankError = Done()
    if lease is not None:
        lease.stop()  # a commit of the part, or its removal, follows: the staging dir is done with
    if part.leads(coord.rank) and part.index != 0:
        try:
            m = outcome.manifest
            record = PartRecord(commit=commit_record(outcome.raw, m.save_id, m.format_version), part=part,
                                world_size=m.topology.world_size)
            publish_part(storage, path, staged.staging, outcome.raw, record,
                         {name: text.encode() for name, text in outcome.tables})
        except (ShardfmtError, OSError) as e:
            msg = RankError.of(coord.rank, e)
    outcomes = coord.gather(msg, Done.from_json, "committing every node's part")
    if any(isinstance(o, RankError) for o in outcomes):
        if part.leads(coord.rank):  # no node keeps a part of a save that is not on every node
            _commit.abort(storage, path)
            _commit.abort(storage, staged.staging)
        coord.raise_failures(outcomes, "committing every node's part")
