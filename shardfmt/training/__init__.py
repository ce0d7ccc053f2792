"""The training layer: the Checkpointer (save, restore with rank-consistent fallback, retention,
archive), roots, RNG, the resumable sampler and model/optimizer state helpers."""
