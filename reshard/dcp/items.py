"""Read DCP items by byte range: undo their stream transforms, check their zip CRCs, and load
them with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
import zlib
from typing import Any

import torch

from reshard._shardfmt import BufferFile, Storage
from reshard.dcp.metadata import DcpLocation
from reshard.errors import DcpImportError

_CRC_READ = 16 << 20  # bytes per read while checking a zip member's CRC


class Unloadable(DcpImportError):
    """An item's pickle names a global ``weights_only`` refuses (a custom class): intact but unsupported."""


def check_crc(data, where: str) -> None:
    """Verify the CRC-32 that torch.save's zip container records for each member (torch.load does not).

    DCP keeps no checksums of its own; this catches flipped bits in an item's bytes. A CRC of 0
    means torch.save did not compute one (``compute_crc32=False``) and is not checked; a
    legacy (non-zip) ``torch.save`` item has none.
    """
    if bytes(data[:4]) != b"PK\x03\x04":
        return
    mv = memoryview(data).cast("B")
    try:
        with zipfile.ZipFile(BufferFile(mv)) as zf:
            for info in zf.infolist():
                if info.CRC == 0 or info.file_size == 0:
                    continue
                if info.compress_type != zipfile.ZIP_STORED:
                    with zf.open(info) as member:
                        while member.read(_CRC_READ):
                            pass  # ZipExtFile checks the CRC when it reaches the end
                    continue
                head = bytes(mv[info.header_offset:info.header_offset + 30])
                if len(head) != 30 or head[:4] != b"PK\x03\x04":
                    raise zipfile.BadZipFile(f"no local header for {info.filename!r}")
                name_len, extra_len = struct.unpack("<HH", head[26:30])
                start = info.header_offset + 30 + name_len + extra_len
                body = mv[start:start + info.compress_size]
                if len(body) != info.compress_size or zlib.crc32(body) != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        raise DcpImportError(f"{where}: corrupt item: {e}") from None


class ItemReader:
    """Read DCP items by byte range, undoing their stream transforms (decompression)."""

    def __init__(self, storage: Storage, root: str, extension_registry) -> None:
        self.storage = storage
        self.root = root
        self.bytes_read = 0
        self._registry = extension_registry
        self._readers: dict[str, Any] = {}

    def path(self, loc: DcpLocation) -> str:
        return self.storage.join(self.root, loc.relative_path)

    def raw(self, loc: DcpLocation, what: str) -> bytes | bytearray:
        reader = self._readers.get(loc.relative_path)
        if reader is None:
            reader = self._readers[loc.relative_path] = self.storage.open_reader(self.path(loc), within=self.root)
        buf = bytearray(loc.length)
        if loc.length:
            reader.readinto(loc.offset, [memoryview(buf)])
        self.bytes_read += loc.length
        if not loc.transforms:
            return buf
        if self._registry is None:
            from torch.distributed.checkpoint._extension import ExtensionRegistry

            self._registry = ExtensionRegistry()
        from torch.distributed.checkpoint._extension import StreamTransformExtension

        try:
            stream: Any = io.BytesIO(buf)
            for ext in self._registry.from_descriptor_list(list(loc.transforms)):
                if isinstance(ext, StreamTransformExtension):
                    stream = ext.transform_from(stream)
            return stream.read(-1)
        except Exception as e:  # noqa: BLE001 - unknown transform, missing codec, corrupt stream
            raise DcpImportError(f"{self.path(loc)}: {what}: cannot undo transforms {list(loc.transforms)} "
                                 f"({type(e).__name__}: {e})") from None

    def load(self, loc: DcpLocation, what: str) -> Any:
        data = self.raw(loc, what)
        check_crc(data, f"{self.path(loc)}: {what}")
        try:
            return torch.load(BufferFile(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - corrupt bytes, or a global weights_only refuses
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            err = Unloadable if isinstance(e, pickle.UnpicklingError) else DcpImportError
            raise err(f"{self.path(loc)}: {what}: bytes [{loc.offset}, {loc.offset + loc.length}) do not load "
                      f"with torch.load(weights_only=True) ({type(e).__name__}: {first})") from None

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()


__all__ = ["ItemReader", "Unloadable", "check_crc"]
