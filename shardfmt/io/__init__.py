"""The io layer: byte stores (local disk, fsspec/S3) behind one narrow interface, ``store.ByteStore``.
Bytes only: how a save becomes a checkpoint is the commit layer's."""
