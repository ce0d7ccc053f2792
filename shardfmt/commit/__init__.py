"""The commit layer: one interface (``strategy.CommitStrategy``), two strategies: ``rename``
(staging + atomic rename on filesystems) and ``marker`` (COMMITTED last + LEASE on object stores)."""
