"""Events from a worker to the launching process, over a socket pair.

Each frame is a pickled list of events (see reporting/events.py) behind an 8-byte
length: one event, or a batch of them in the order they were sent. The other
way, the launching process answers a worker's prompt (launch/debugging.py). A
write returns only once the kernel holds the bytes, so a worker may exit
right after sending; a multiprocessing Queue's feeder thread would lose the
message, and tensors sent through it would travel as shared-memory handles
that die with the worker. Payloads are plain bytes here.
"""

from __future__ import annotations

import os
import pickle
import struct
import threading
import time

from notebook_accel.reporting.events import ChannelEvent, RunEvent, Unreadable

_HEADER = struct.Struct("<Q")

# Batched events wait at most this long before they are written.
BATCH_SECONDS = 0.1


class ChannelWriter:
    """The worker's end: `send(event)` from any thread.

    `send(..., batch=True)` suits frequent small events (a metric every
    step): they are written together at most every BATCH_SECONDS, so the
    launching process wakes a few times a second instead of once a step.
    Any unbatched send writes the pending batch first, keeping the order.
    """

    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()
        self._pending: list[ChannelEvent] = []
        self._flusher: threading.Thread | None = None

    @property
    def fd(self) -> int:
        """The descriptor events go down (a socket: answers to prompts come back on it)."""
        return self._fd

    def send(self, event: ChannelEvent, batch: bool = False) -> None:
        """Write `event` now, or with the next batch; raises if it cannot be pickled."""
        with self._lock:
            if batch:
                self._pending.append(event)
                if self._flusher is None:
                    self._flusher = threading.Thread(
                        target=self._flush_periodically, name="notebook_accel-channel", daemon=True
                    )
                    self._flusher.start()
                return
            # Pickled before the batch goes, so that an event that cannot be
            # pickled leaves the pending batch and the pipe as they were.
            frame = _frame([event])
            self._write_pending()
            self._write(frame)

    def flush(self) -> None:
        """Write the pending batch now."""
        with self._lock:
            self._write_pending()

    def _flush_periodically(self) -> None:
        while True:
            time.sleep(BATCH_SECONDS)
            self.flush()

    def _write_pending(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            self._write(_frame(pending))

    def _write(self, frame: bytes) -> None:
        data = memoryview(frame)
        while data:
            written = os.write(self._fd, data)
            data = data[written:]


def _frame(events: list[ChannelEvent]) -> bytes:
    body = pickle.dumps(events, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class ChannelReader:
    """The launcher's end for one worker: feed it bytes as they arrive, get whole events back.

    A frame that cannot be unpickled (a class only the worker has, say)
    becomes one `Unreadable` event, and the frames after it are read as usual.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[RunEvent]:
        """Take the next bytes of the stream; return the events they complete, in order."""
        self._buffer += data
        events: list[RunEvent] = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            body = bytes(self._buffer[_HEADER.size : end])
            del self._buffer[:end]
            try:
                events.extend(pickle.loads(body))
            except Exception as error:  # noqa: BLE001 - e.g. a class this process lacks
                events.append(Unreadable(self.rank, f"{type(error).__name__}: {error}"))
        return events
