"""v2: a rank's index, written by the rank itself once its data files are (spec section 5).

The index records the rank's data files (sizes, header digests, shard-aligned chunk digests)
and its per-rank values; the rank reports its index's name, size and digest (a ``RankEntry``)
to the committing rank, which is all that rank needs of it: the root manifest's cost does
not grow with what the ranks wrote.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardfmt.format import hashing
from shardfmt.format.index import IndexedFile, RankEntry, RankIndex, rank_index_name
from shardfmt.format.manifest import INDEX_DIR, FileRecord
from shardfmt.io.store import Storage


def write_rank_index(storage: Storage, staging: str, *, rank: int, save_id: str, name_tag: str | None,
                     files: Mapping[str, FileRecord | IndexedFile], values: Mapping[str, Any]) -> RankEntry:
    """Write rank ``rank``'s index into ``staging`` (values already typed JSON; ``files`` may
    hold a base's files an incremental save takes shards from); return its entry."""
    raw = RankIndex(save_id=save_id, rank=rank, values=values,
                    files={n: f if isinstance(f, IndexedFile) else IndexedFile.of(f) for n, f in files.items()}).to_json()
    name = rank_index_name(rank, name_tag)
    storage.makedirs(storage.join(staging, INDEX_DIR))
    storage.write_bytes(storage.join(staging, name), raw)
    return RankEntry(name=name, size=len(raw), digest=hashing.digest_bytes(raw))
