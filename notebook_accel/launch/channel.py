"""Messages from a worker to the launching process, over a pipe.

Each message is a pickled `(kind, payload)` tuple behind an 8-byte length.
A pipe write returns only once the kernel holds the bytes, so a worker may
exit right after sending; a multiprocessing Queue's feeder thread would lose
the message, and tensors sent through it would travel as shared-memory
handles that die with the worker. Payloads are plain bytes here.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
from typing import Any

_HEADER = struct.Struct("<Q")

_worker_channel: ChannelWriter | None = None


class ChannelWriter:
    """The worker's end: `send(kind, payload)` from any thread."""

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()

    def send(self, kind: str, payload: Any) -> None:
        body = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(_HEADER.pack(len(body)) + body)
        with self._lock:
            while data:
                written = os.write(self._fd, data)
                data = data[written:]


def worker_channel() -> ChannelWriter | None:
    """The channel to the launching process, or None outside a launched worker."""
    return _worker_channel


def set_worker_channel(channel: ChannelWriter | None) -> None:
    global _worker_channel
    _worker_channel = channel


class ChannelReader:
    """The launcher's end: feed it bytes as they arrive, get whole messages back."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, Any]]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(bytes(self._buffer[_HEADER.size : end])))
            del self._buffer[:end]
        return messages
