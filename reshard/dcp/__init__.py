"""Import a torch.distributed.checkpoint (DCP) directory as a shardfmt checkpoint.

Modules: ``unpickler`` (the restricted unpickler of ``.metadata``), ``metadata`` (its stand-ins
checked into records), ``plan`` (pure: chunks -> rank files and parts, values regrouped),
``items`` (reading and checking ``torch.save`` items), ``importer`` (``import_dcp``).

A DCP directory holds ``.metadata`` (a pickle: every tensor's dtype, global shape and saved
chunks, and where each item's bytes are) and ``__<rank>_<n>.distcp`` files, each a
concatenation of items: a tensor chunk or a non-tensor value, each ``torch.save``d, possibly
through a stream transform (compression). Protocol of ``import_dcp``:

1) refuse unless the caller states ``trust_pickle=True``, and a DST that is SRC, holds it or
   lies inside it; read ``.metadata`` through the allowlist unpickler of ``dcp.unpickler``, checked by ``dcp.metadata`` (a
   file that names any other global is refused);
2) stat every ``.distcp`` file the metadata names, then ``plan_import`` (pure): check every
   chunk has a stored item inside its file, the chunks of every tensor tile it, the dtypes
   are storable; map each file to its writer's rank (``__1_0.distcp`` -> rank 1); cut each
   rank's chunks into parts of at most ``memory_budget`` decoded bytes;
3) read and decode every non-tensor item (``torch.load(weights_only=True)``), regroup the
   items DCP flattened out of one tensor-free dict or list into that one value, as
   ``shardfmt.save`` names it (``group_values``), and encode it as typed JSON: a value that
   cannot be (a custom class, a set) is refused, naming the key, unless
   ``skip_unsupported_values`` (then the whole value is skipped with a warning and reported);
4) open a ``CheckpointWriter`` on DST; per part: read each chunk's byte range, check the
   CRC-32s of its ``torch.save`` zip container (DCP keeps no checksum of its own), decode it
   with ``torch.load(weights_only=True)``, check dtype and shape against the metadata, and
   ``write_rank(rank, shards, part=k)``; add the values; commit. Any failure aborts the
   staging directory: DST is never left half-written.

Each DCP chunk becomes one shard with the same box; DCP writes each replicated chunk once,
so nothing is duplicated. Placement is not recorded (DCP's metadata does not say how chunks
map to a mesh); the topology is ``world_size`` = highest rank found + 1, with no named mesh.

Trade-offs: a chunk is decoded whole (``torch.load`` reads a whole ``torch.save`` item), so
peak memory is about ``max(memory_budget, largest chunk)`` plus one encoded item; a chunk
larger than the budget is written as a part of its own rather than split. Only the
``.metadata`` of a collective save is read (not per-rank ``__<r>.metadata`` files of
``no-collectives`` saves), and only DCP's default ``torch.save`` item serialization.
"""
