"""Transitional (issue 17): the names other modules imported from here before the byte store
was split into ``io.store`` (the interface, ``IOStats``), ``io.local`` (``LocalStorage``) and
``io.posix``. New code imports from those; this module goes once no import of it is left.
"""

from __future__ import annotations

from shardfmt.io.local import LocalStorage
from shardfmt.io.posix import direct_io_enabled, open_regular
from shardfmt.io.store import (
           PROCESS_IO,
           ByteStore,
           FileReader,
           FileWriter,
           IOStats,
           Storage,
           io_stats,
)

__all__ = ["PROCESS_IO", "ByteStore", "FileReader", "FileWriter", "IOStats", "LocalStorage", "Storage",
           "direct_io_enabled", "io_stats", "open_regular"]
