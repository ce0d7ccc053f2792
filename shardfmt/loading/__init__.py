"""The load layer: open a checkpoint (``reader``), sort a state dict against it (``request``,
``targets``), plan the reads (``planner``, pure) and run them (``executor``). A peer of ``saving``."""
