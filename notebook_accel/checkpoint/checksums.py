"""CRC-32 checksums of checkpoint files, computed while they are written.

zlib's CRC-32 runs at about 3 GB/s; reading a 1 GB file back to checksum it
would add a quarter to a save that takes about a second. So the checksum is
computed from the bytes on their way to the disk, on a helper thread while
the write or the flush runs (zlib, file writes and fsync release the GIL):

- `ChecksummingFile` wraps a file that `torch.save` writes through;
- `safetensors_checksum` joins the checksums of the tensors in memory, summed
  while the file is flushed to disk (safetensors holds the GIL while it
  writes), in the order of the file's header (`crc32_combine`, zlib's
  algorithm: no byte is read twice).

Every checksum reads "crc32:" and 8 hex digits, the CRC-32 of the whole file,
so `file_checksum` (used on load) recomputes it from the file alone.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Chunks smaller than this are summed inline: a thread hand-off costs more.
_INLINE_BYTES = 1 << 20
_POLY = 0xEDB88320  # CRC-32's polynomial, reflected


def file_checksum(path: str | os.PathLike) -> str:
    """The file's CRC-32 (zlib), as the manifest records it: "crc32:" and 8 hex digits."""
    crc = 0
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size:  # an empty file cannot be mapped
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                crc = zlib.crc32(mapped)
    return _formatted(crc)


def _formatted(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


class ChecksummingFile:
    """A binary file opened for writing that keeps the CRC-32 of what was written.

    Large chunks are summed on a helper thread while this one writes them;
    the chunk is finished with on both sides before `write` returns (torch.save
    may reuse its buffer right after).
    """

    def __init__(self, file: Any) -> None:
        self._file = file
        self._crc = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="notebook_accel-checksum")

    def write(self, data: Any) -> int:
        """Write `data` (any bytes-like object) and add it to the checksum."""
        if memoryview(data).nbytes < _INLINE_BYTES:
            self._crc = zlib.crc32(data, self._crc)
            return self._file.write(data)
        summing = self._pool.submit(zlib.crc32, data, self._crc)
        try:
            written = self._file.write(data)
        finally:
            self._crc = summing.result()
        return written

    def flush(self) -> None:
        """Flush the underlying file."""
        self._file.flush()

    def checksum(self) -> str:
        """The checksum of everything written so far."""
        return _formatted(self._crc)

    def close(self) -> None:
        """Stop the helper thread (the file itself is its owner's to close)."""
        self._pool.shutdown(wait=True)


def tensor_checksums(tensors: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Each tensor's (CRC-32, size in bytes) of its bytes as safetensors stores them."""
    sums = {}
    for name, tensor in tensors.items():
        raw = _raw_bytes(tensor)
        sums[name] = (zlib.crc32(raw), raw.nbytes)
    return sums


def _raw_bytes(tensor: Any) -> memoryview:
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def safetensors_checksum(path: str | os.PathLike, sums: dict[str, tuple[int, int]]) -> str:
    """The CRC-32 of a safetensors file from its header and its tensors' checksums.

    Falls back to reading the whole file if the header does not lay out exactly
    the tensors that were summed (it always should).
    """
    with open(path, "rb") as file:
        prefix = file.read(8)
        (header_size,) = struct.unpack("<Q", prefix)
        header = file.read(header_size)
    layout = sorted(
        (entry["data_offsets"], name)
        for name, entry in json.loads(header).items()
        if name != "__metadata__"
    )
    expected = 0
    for (start, end), name in layout:
        if name not in sums or start != expected or end - start != sums[name][1]:
            return file_checksum(path)
        expected = end
    if len(layout) != len(sums) or os.path.getsize(path) != 8 + header_size + expected:
        return file_checksum(path)
    crc = zlib.crc32(header, zlib.crc32(prefix))
    for (start, end), name in layout:
        crc = crc32_combine(crc, sums[name][0], end - start)
    return _formatted(crc)


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A+B from CRC-32(A), CRC-32(B) and len(B) (zlib's crc32_combine)."""
    return _multiply(_x_to_the_8n(length2), crc1) ^ crc2


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order, as zlib's multmodp)."""
    product = 0
    mask = 1 << 31
    while mask:
        if a & mask:
            product ^= b
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> list[int]:
    # x^(2^k) modulo the polynomial, k = 0..63
    table = [1 << 30]  # x^1
    for _ in range(63):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X_TO_2_TO_THE = _powers_of_x()


def _x_to_the_8n(n: int) -> int:
    """x^(8n) modulo the polynomial: appending n zero bytes."""
    power = 1 << 31  # x^0
    k = 3  # 8n = n * 2^3
    while n:
        if n & 1:
            power = _multiply(_X_TO_2_TO_THE[k % 64], power)
        n >>= 1
        k += 1
    return power
