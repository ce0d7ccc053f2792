"""The record of a node part (``NODE_PART``): one node's share of a checkpoint saved on the
node-local tier (spec/ROOTS.md section 3; written and read by ``commit.nodepart``). Pure."""

from __future__ import annotations

import dataclasses

import orjson

from shardfmt.errors import IntegrityError, ShardfmtError
from shardfmt.format import hashing
from shardfmt.format.manifest import CommitRecord
from shardfmt.format.parse import parse_commit

NODE_PART_NAME = "NODE_PART"
MAX_PART_BYTES = 1 << 20  # a node's record names its ranks: 2^20 bytes hold > 100k of them
MAX_NODES = 1 << 16
MAX_ROOT_CHARS = 4096
MARKS_DIR = "NODES"  # a shared copy being made by every node: NODES/node_<k> once node k copied its files
COMMITTER_NAME = "COMMITTER"  # ... and the one claim to commit it (commit.joint)


def mark_name(index: int) -> str:
    """The marker node ``index`` writes once it has copied its files to the shared copy."""
    return f"{MARKS_DIR}/node_{index:05d}"


def is_joint_file(name: str) -> bool:
    """Whether ``name`` (relative to a checkpoint) is a marker or the claim of a joint copy."""
    return name == COMMITTER_NAME or (name.startswith(MARKS_DIR + "/node_") and name[len(MARKS_DIR) + 6:].isdigit())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodePart:
    """This process's node in a save on the node-local tier: node ``index`` of ``count`` (nodes
    numbered by their lowest rank), holding ``ranks`` (ascending); ``tier`` names the tier as the
    job was given it (the same on every rank: what the ranks agree on); ``root`` is the URL of the
    shared tier whose saves the part belongs to (the Checkpointer's root: a restore takes only its
    own root's parts)."""

    index: int
    count: int
    ranks: tuple[int, ...]
    tier: str = ""
    root: str = ""

    def __post_init__(self) -> None:
        if not (0 <= self.index < self.count <= MAX_NODES) or not self.ranks or list(self.ranks) != sorted(set(self.ranks)):
            raise ValueError(f"a node part is node index < count <= {MAX_NODES} with ascending ranks, got {self}")

    def leads(self, rank: int) -> bool:
        """Whether ``rank`` is the node's leader (its lowest rank), which stages and commits its part."""
        return rank == self.ranks[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartRecord:
    """The content of ``NODE_PART``."""

    commit: CommitRecord
    part: NodePart
    world_size: int

    def to_json(self) -> bytes:
        c = self.commit
        return orjson.dumps({"save_id": c.save_id, "manifest_digest": c.manifest_digest,
                             "format_version": c.format_version, "node": self.part.index, "nodes": self.part.count,
                             "ranks": list(self.part.ranks), "world_size": self.world_size, "root": self.part.root},
                            option=orjson.OPT_SORT_KEYS) + b"\n"

    @classmethod
    def parse(cls, raw: bytes, *, source: str) -> PartRecord:
        try:
            o = orjson.loads(raw)
            commit = parse_commit(orjson.dumps({"format": "shardfmt", "save_id": o["save_id"],
                                                "manifest_digest": o["manifest_digest"],
                                                "format_version": o["format_version"]}), source=source)
            ranks = o["ranks"]
            world = o["world_size"]
            if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks) \
                    or not isinstance(world, int) or isinstance(world, bool) or not ranks or ranks[-1] >= world:
                raise ValueError("ranks must be ints below world_size")
            root = o["root"]
            if not isinstance(root, str) or len(root) > MAX_ROOT_CHARS:
                raise ValueError(f"root must be a string of at most {MAX_ROOT_CHARS} characters")
            part = NodePart(index=o["node"], count=o["nodes"], ranks=tuple(ranks), root=root)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, ShardfmtError) as e:
            raise IntegrityError(f"{source}: not a node part record: {e}") from None
        return cls(commit=commit, part=part, world_size=world)


def commit_record(manifest_bytes: bytes, save_id: str, format_version: int) -> CommitRecord:
    """The ``COMMITTED`` record of the manifest ``manifest_bytes``."""
    return CommitRecord(save_id=save_id, manifest_digest=hashing.digest_bytes(manifest_bytes),
                        format_version=format_version)
