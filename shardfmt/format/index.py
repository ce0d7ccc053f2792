"""v2's per-rank metadata: the rank table (in parts) and one rank index per rank. No I/O.

A v2 root manifest lists no file and no shard: what a rank wrote is described by that rank's
own index, ``index/rank_<r>.json``, written by the rank after its data files (its files'
sizes, header digests and shard-aligned chunk digests, and its per-rank values). The root
vouches for the indexes through the rank table, ``index/ranks_<first>.json``, parts of at
most ``RANKS_PER_PART`` ranks each giving a rank index's size and digest; the root holds
each part's digest. So a reader that needs what ranks 17 and 18 wrote reads the root, one
part and two indexes, whatever the job's size (spec/FORMAT.md section 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from shardfmt.format import hashing
from shardfmt.format.manifest import FORMAT_NAME, INDEX_DIR, FileRecord, RankPart

RANKS_PER_PART = 1024  # ranks per rank-table part: ~70 KB of JSON, what one reader reads of it
DIGEST_HEX = 32  # hex digits of one raw xxh3-128 digest
MAX_INDEX_BYTES = 1 << 30  # a rank index (its chunk digests, its per-rank values)
MAX_PART_BYTES = 1 << 24  # a rank-table part: 1024 entries of ~70 bytes, with room to spare


def rank_index_name(rank: int, save_id: str | None = None) -> str:
    """Return the name of rank ``rank``'s index; ``save_id`` (object stores) goes into it, as
    into data file names, so two saves of one prefix never write the same object (spec section 2)."""
    tag = f".{save_id}" if save_id else ""
    return f"{INDEX_DIR}/rank_{rank:05d}{tag}.json"


def rank_part_name(first: int, save_id: str | None = None) -> str:
    """Return the name of the rank-table part that starts at rank ``first`` (``save_id``: as above)."""
    tag = f".{save_id}" if save_id else ""
    return f"{INDEX_DIR}/ranks_{first:08d}{tag}.json"


def _dumps(obj: dict) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) + b"\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexedFile:
    """A data file as its writer's index records it: sizes, header digest and chunk digests.

    ``chunks`` are the raw 16-byte digests of the file's shard-aligned chunks, concatenated
    in file order (spec section 6). ``keys``: a base's file that an incremental checkpoint
    references (section 4.10), the header keys of the shards it takes; None for an own file."""

    size: int
    header_size: int
    header_digest: str
    digest: str
    chunks: bytes
    keys: tuple[str, ...] | None = None

    @property
    def chunk_count(self) -> int:
        return len(self.chunks) // 16

    def chunk_digests(self) -> tuple[str, ...]:
        """The chunk digests as digest strings (what a ``FileRecord`` holds)."""
        c = self.chunks
        return tuple(hashing.format_digest(c[i:i + 16]) for i in range(0, len(c), 16))

    def to_json(self) -> dict:
        out = {"size": self.size, "header_size": self.header_size, "header_digest": self.header_digest,
               "digest": self.digest, "chunks": self.chunks.hex()}
        if self.keys is not None:
            out["keys"] = list(self.keys)
        return out

    @classmethod
    def of(cls, record: FileRecord) -> IndexedFile:
        return cls(size=record.size, header_size=record.header_size, header_digest=record.header_digest,
                   digest=record.digest, chunks=b"".join(hashing.parse_digest(d) for d in record.chunks))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankIndex:
    """What one rank wrote: its data files, and its per-rank values (typed JSON)."""

    save_id: str
    rank: int
    files: Mapping[str, IndexedFile] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return _dumps({"format": FORMAT_NAME, "kind": "rank", "save_id": self.save_id, "rank": self.rank,
                       "files": {k: v.to_json() for k, v in sorted(self.files.items())},
                       "values": dict(sorted(self.values.items()))})


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEntry:
    """A rank's entry in the rank table: the name, size and digest of its index."""

    name: str
    size: int
    digest: str

    def to_json(self) -> dict:
        return {"name": self.name, "size": self.size, "digest": self.digest}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTablePart:
    """The rank table for ranks ``[first, end)``: an entry per rank that has an index."""

    save_id: str
    first: int
    end: int
    ranks: Mapping[int, RankEntry] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return _dumps({"format": FORMAT_NAME, "kind": "ranks", "save_id": self.save_id, "first": self.first,
                       "end": self.end, "ranks": {str(r): e.to_json() for r, e in sorted(self.ranks.items())}})


def rank_table(save_id: str, world_size: int, entries: Mapping[int, RankEntry], *,
               name_tag: str | None = None) -> list[tuple[RankPart, bytes]]:
    """Cut the rank table of a ``world_size``-rank save into parts; return each part's root
    record with its bytes (what the writer stores under ``part.name``). Deterministic.
    ``name_tag``: the save id on object stores (``rank_part_name``)."""
    out = []
    for first in range(0, world_size, RANKS_PER_PART):
        end = min(first + RANKS_PER_PART, world_size)
        part = RankTablePart(save_id=save_id, first=first, end=end,
                             ranks={r: entries[r] for r in range(first, end) if r in entries})
        raw = part.to_json()
        out.append((RankPart(first=first, end=end, name=rank_part_name(first, name_tag), size=len(raw),
                             digest=hashing.digest_bytes(raw)), raw))
    return out
