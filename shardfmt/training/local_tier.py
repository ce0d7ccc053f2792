"""The Checkpointer's node-local tier (``local=``): save on each node's own disk, copy to the root
behind the training, restore from the fastest tier with a complete copy (spec/ROOTS.md section 3).

Saving (every rank, in ``Checkpointer.save``)::

    1) the ranks learn whether any node is still copying an earlier save (one all-gather of a
       flag); the ``replicate`` policy then says, alike on every rank, whether this save is
       copied: "skip" leaves it on the local tier only, "wait" first waits for those copies
    2) the save writes each node's part on its own disk (``saving.nodes``)
    3) each node's leader queues the copy of its part to the root (``replicate.Replicator``:
       the last node to finish commits the root's copy), keeps its ``keep`` newest parts and
       removes dead saves' staging dirs on its disk

Restoring: every rank lists its own node's parts and says which steps it could restore from
its node (a part of this job's world size whose node holds exactly this rank's node's ranks: a
changed node-to-rank mapping makes none usable); a step every rank can restore, with one save
id, is a candidate, tried before the root's copy of the same step. A rank reads what its node
holds from its disk and the rest (another node's files: replicated tensors, their indexes)
from the root's copy of the same save, when that is committed (``io.nodepart``); otherwise
that step cannot be restored from the tier, and every rank falls back together. A lost node's
parts make its steps no candidates: the root's copies remain.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable

from shardfmt.commit.joint import committed_save
from shardfmt.commit.names import step_dir_name
from shardfmt.commit.nodepart import list_parts
from shardfmt.errors import ShardfmtError
from shardfmt.format.nodepart import NodePart
from shardfmt.io.local import LocalStorage
from shardfmt.io.nodepart import NodePartStorage
from shardfmt.io.registry import get_storage
from shardfmt.io.store import Storage
from shardfmt.training.nodes import NodeMap, local_root, node_name
from shardfmt.training.options import ArchivePolicy, LocalTierPolicy
from shardfmt.training.ranks import Ranks
from shardfmt.training.replicate import Replicator, open_part
from shardfmt.training.roots import collect_garbage

log = logging.getLogger("shardfmt")
POLL_SECONDS = 0.5  # how often the ranks ask each other whether any node still copies
_FAILURES = (ShardfmtError, OSError)


class LocalTier:
    """This rank's view of the node-local tier: its node, its node's parts, its node's copies."""

    def __init__(self, policy: LocalTierPolicy, shared: Storage, shared_root: str, ranks: Ranks,
                 retry: ArchivePolicy, storage_options: dict | None = None) -> None:
        self.policy = policy
        self.storage = LocalStorage()
        self.shared, self.shared_root = shared, shared_root
        self.url = shared.url(shared_root)  # what every part records: a restore takes its own root's parts only
        self._options = storage_options
        if "{node}" not in policy.url and not shared.remote and local_root(policy.url, "") == shared_root:
            raise ValueError(f"Checkpointer: local= {policy.url!r} is the root itself: give each node's own disk")
        self.ranks = ranks
        self._retry = retry
        self._map: NodeMap | None = None
        self._replicator: Replicator | None = None

    # ------------------------------------------------------------------ where
    def node_map(self) -> NodeMap:
        """Every rank's node (a collective the first time: every rank calls it at the same point)."""
        if self._map is None:
            self._map = NodeMap.discover(self.ranks, node_name(self.policy.node))
        return self._map

    def part(self) -> NodePart:
        return self.node_map().part(self.ranks.rank(), self.policy.url, self.url)

    def leads(self) -> bool:
        return self.part().leads(self.ranks.rank())

    @property
    def root(self) -> str:
        m = self.node_map()
        return local_root(self.policy.url, m.names[m.of[self.ranks.rank()]])

    def path(self, step: int) -> str:
        return self.storage.join(self.root, step_dir_name(step))

    @property
    def errors(self) -> list[str]:
        return self._replicator.errors if self._replicator is not None else []

    # ------------------------------------------------------------------ saving
    def _behind(self) -> bool:
        """Whether any node still copies an earlier save (a collective: the same on every rank)."""
        busy = self._replicator is not None and self._replicator.any_busy()
        return any(self.ranks.all_gather(bool(busy)))

    def wait_all(self) -> float:
        """Every rank waits until no node copies anything (polled together, so no rank sits in a
        collective while a leader copies); return the seconds waited."""
        t0 = time.perf_counter()
        while self._behind():
            time.sleep(POLL_SECONDS)
        return time.perf_counter() - t0

    def before_save(self, step: int) -> bool:
        """1) Whether this save is copied to the root (the same answer on every rank)."""
        if not self._behind():
            return True
        if self.policy.replicate == "skip":
            if self.ranks.rank() == 0:
                log.warning("shardfmt: step %d stays on the node-local tier only: an earlier save is still being "
                            "copied to %s (replicate='skip')", step, self.url)
            return False
        waited = self.wait_all()
        if self.ranks.rank() == 0:
            log.warning("shardfmt: step %d waited %.3f s for the copy of an earlier save to %s (replicate='wait')",
                        step, waited, self.url)
        return True

    def after_save(self, step: int, replicate: bool, *, then: Callable[[int], None] | None = None) -> None:
        """3) The node's leader queues the copy (and ``then(step)`` after it, on the copying
        thread: rank 0's upkeep of the root) and tidies its disk; never raises into training."""
        if not self.leads():
            return
        path = self.path(step)
        if replicate:
            if self._replicator is None:
                self._replicator = Replicator(self.storage, self.shared, self.shared_root,
                                              attempts=self._retry.attempts, backoff=self._retry.backoff)
            self._replicator.copy(step_dir_name(step), path, then=then)
        try:
            self._prune()
            collect_garbage(self.storage, self.root, lease_seconds=self.storage.lease_seconds)
        except _FAILURES as e:  # tidying never fails a committed save
            warnings.warn(f"{self.root}: tidying the node-local tier after step {step} failed: {e}", stacklevel=3)

    def _parts(self) -> list:
        """This node's parts of this root's saves, oldest first (another root's are left alone)."""
        return [p for p in list_parts(self.storage, self.root) if p[2].part.root == self.url]

    def _prune(self) -> None:
        """Keep this node's ``keep`` newest parts, and any being copied."""
        parts = self._parts()
        for _, path, _ in parts[:-self.policy.keep]:
            if self._replicator is None or not self._replicator.busy(path):
                self.storage.remove_tree(path)

    def wait(self) -> None:
        if self._replicator is not None:
            self._replicator.wait()

    def close(self) -> None:
        if self._replicator is not None:
            self._replicator.close()

    # ------------------------------------------------------------------ restoring
    def forget_after(self, step: int | None) -> None:
        """After a restore of ``step``: the node's leader removes its parts of later steps (the
        future this job abandoned: none of them loaded, and the job will save its steps anew)."""
        if step is None or not self.leads():
            return
        try:
            for s, path, _ in self._parts():
                if s > step and (self._replicator is None or not self._replicator.busy(path)):
                    self.storage.remove_tree(path)
        except _FAILURES as e:
            warnings.warn(f"{self.root}: removing the node-local parts after step {step} failed: {e}", stacklevel=3)

    def usable(self) -> list[list]:
        """The ``[step, save id]`` of every part on this rank's node this job could restore from
        it: of this world size, with this node's ranks exactly (newest first)."""
        me, world = self.part(), self.ranks.world()
        try:
            parts = self._parts()
        except _FAILURES as e:
            warnings.warn(f"{self.root}: cannot list the node-local tier: {e}", stacklevel=3)
            return []
        return [[step, rec.commit.save_id] for step, _, rec in reversed(parts)
                if rec.world_size == world and rec.part.ranks == me.ranks and rec.part.count == me.count
                and rec.part.index == me.index]

    def candidates(self) -> list[list]:
        """The steps every rank can restore from its node (a collective), as restore candidates."""
        per_rank = self.ranks.all_gather(self.usable())
        common = {tuple(c) for c in per_rank[0]}
        for cs in per_rank[1:]:
            common &= {tuple(c) for c in cs}
        return [[step, "local", step_dir_name(step), None] for step, _ in sorted(common, reverse=True)]

    def reader(self, path: str) -> NodePartStorage:
        """A storage that reads the part at ``path`` from this node's disk, and what another node
        holds from the root's copy of the same save when that is committed."""
        _, m, _ = open_part(self.storage, path)
        shared, root = get_storage(self.url, self._options)  # its own: the load counts its bytes there
        there = shared.join(root, path.rstrip("/").rpartition("/")[2])
        try:
            same = committed_save(shared, there) == m.save_id
        except _FAILURES:
            same = False
        return NodePartStorage(path, (shared, there) if same else None)
