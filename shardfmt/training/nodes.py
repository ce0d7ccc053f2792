"""Which ranks share a node, and where each node's local tier is (``Checkpointer(local=...)``).

A node is named by ``node=`` (the same on the ranks of one machine), else ``$SHARDFMT_NODE``,
else the host name. The ranks all-gather their names once; nodes are numbered in the order of
their lowest rank, so node 0 holds rank 0 and every rank derives the same map.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from shardfmt.format.nodepart import NodePart
from shardfmt.training.ranks import Ranks

NODE_ENV = "SHARDFMT_NODE"


def node_name(given: str | None) -> str:
    """This process's node name: ``given``, else ``$SHARDFMT_NODE``, else the host name."""
    return given or os.environ.get(NODE_ENV) or socket.gethostname()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeMap:
    """Every rank's node: ``names[k]`` is node ``k``'s name, ``of[r]`` rank ``r``'s node index."""

    names: tuple[str, ...]
    of: tuple[int, ...]

    @classmethod
    def discover(cls, ranks: Ranks, name: str) -> NodeMap:
        return cls.of_names(ranks.all_gather(name))

    @classmethod
    def of_names(cls, per_rank: list[str]) -> NodeMap:
        index: dict[str, int] = {}
        of = tuple(index.setdefault(n, len(index)) for n in per_rank)
        return cls(names=tuple(index), of=of)

    def part(self, rank: int, tier: str, root: str = "") -> NodePart:
        """``rank``'s node as a save on the tier ``tier`` for the root ``root`` names it."""
        k = self.of[rank]
        return NodePart(index=k, count=len(self.names), ranks=tuple(r for r, n in enumerate(self.of) if n == k),
                        tier=tier, root=root)


def local_root(url: str, name: str) -> str:
    """The node ``name``'s local tier: ``url`` with ``{node}`` replaced by the name."""
    path = url[len("file://"):] if url.startswith("file://") else url
    return os.path.abspath(path.replace("{node}", name))
