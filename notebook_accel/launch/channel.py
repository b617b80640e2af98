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
import time
from typing import Any

_HEADER = struct.Struct("<Q")

_worker_channel: ChannelWriter | None = None


# Batched messages wait at most this long before they are written.
BATCH_SECONDS = 0.1


class ChannelWriter:
    """The worker's end: `send(kind, payload)` from any thread.

    `send(..., batch=True)` suits frequent small messages (a metric every
    step): they are written together at most every BATCH_SECONDS, so the
    launching process wakes a few times a second instead of once a step.
    Any unbatched send writes the pending batch first, keeping the order.
    """

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Any]] = []
        self._flusher: threading.Thread | None = None

    def send(self, kind: str, payload: Any, batch: bool = False) -> None:
        with self._lock:
            if batch:
                self._pending.append((kind, payload))
                if self._flusher is None:
                    self._flusher = threading.Thread(
                        target=self._flush_periodically, name="notebook_accel-channel", daemon=True
                    )
                    self._flusher.start()
                return
            self._write_pending()
            self._write(kind, payload)

    def flush(self) -> None:
        with self._lock:
            self._write_pending()

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(BATCH_SECONDS)
            self.flush()

    def _write_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._write("batch", pending)

    def _write(self, kind: str, payload: Any) -> None:
        body = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        data = memoryview(_HEADER.pack(len(body)) + body)
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
            body = bytes(self._buffer[_HEADER.size : end])
            del self._buffer[:end]
            try:
                kind, payload = pickle.loads(body)
            except Exception as error:  # noqa: BLE001 - e.g. a class this process lacks
                messages.append(("unreadable", f"{type(error).__name__}: {error}"))
                continue
            if kind == "batch":
                messages.extend(payload)
            else:
                messages.append((kind, payload))
        return messages
