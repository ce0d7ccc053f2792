"""An fsspec filesystem over local disk that fails on the Nth write of one rank.

``faulty://`` paths map to local paths. ``FAULTY_RANK``/``FAULTY_AFTER`` choose the rank and
the write count; ``FAULTY_MODE`` is ``enospc`` (raise OSError(ENOSPC)), ``kill`` (SIGKILL
the process) or ``stop`` (SIGSTOP it: a frozen rank).
"""

from __future__ import annotations

import errno
import os
import signal

import fsspec
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

_writes = 0


class _FaultyOpener(LocalFileOpener):
    def write(self, data):
        global _writes
        if os.environ.get("FAULTY_RANK") == os.environ.get("RANK"):
            _writes += 1
            if _writes >= int(os.environ.get("FAULTY_AFTER", "1")):
                mode = os.environ.get("FAULTY_MODE", "enospc")
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if mode == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


class FaultyFileSystem(LocalFileSystem):
    protocol = ("faulty",)

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("faulty://"):
            path = path[len("faulty://"):]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        path = self._strip_protocol(path)
        if "w" in mode or "a" in mode:
            self.makedirs(self._parent(path), exist_ok=True)
            return _FaultyOpener(path, mode, fs=self, **kwargs)
        return super()._open(path, mode, block_size=block_size, **kwargs)


def register() -> None:
    fsspec.register_implementation("faulty", FaultyFileSystem, clobber=True)
