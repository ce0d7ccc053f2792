"""The load layer: open a checkpoint (``reader``), sort a state dict against it (``request``,
``targets``), plan the reads (``planner``, pure) and run them (``executor``, over the files it
opens once, ``files``; direct or buffered as ``trial`` says; dropping what it read through the
page cache, ``pagecache``). A peer of ``saving``."""
