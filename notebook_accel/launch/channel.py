"""A worker's link to the launching process: one socket pair, one framing both ways.

Each frame is a pickled object behind an 8-byte length. Up, from the worker:
a list of events (see reporting/events.py), one event or a batch of them in
the order they were sent. Down, from the launching process: the answer to a
worker's prompt (launch/debugging.py) or a live worker's next call
(live/serve.py). A write returns only once the kernel holds the bytes, so a
worker may exit right after sending; a multiprocessing Queue's feeder thread
would lose the message, and tensors sent through it would travel as
shared-memory handles that die with the worker. Payloads are plain bytes here.

`WorkerPipes` names the descriptors a worker gets, from the supervisor through
every way of starting it (a fork, a fresh interpreter, the template, a
cluster's agent) to `worker_main`.
"""

from __future__ import annotations

import collections
import os
import pickle
import select
import socket
import struct
import threading
import time
from dataclasses import astuple, dataclass
from typing import Any

from notebook_accel.reporting.events import ChannelEvent, RunEvent, Unreadable

_HEADER = struct.Struct("<Q")

# Batched events wait at most this long before they are written.
BATCH_SECONDS = 0.1


@dataclass(frozen=True)
class WorkerPipes:
    """One end of each of a worker's pipes: "stdout" and "stderr" (its descriptors 1 and
    2), "python" (what Python writes to either, in order: launch/output_pipes.py) and
    "channel" (the link, a socket)."""

    stdout: int
    stderr: int
    python: int
    channel: int

    @staticmethod
    def open() -> tuple[WorkerPipes, WorkerPipes]:
        """New pipes: (the launching process's read ends and link, the worker's ends)."""
        link = [end.detach() for end in socket.socketpair()]
        ours, theirs = zip(os.pipe(), os.pipe(), os.pipe(), link, strict=True)
        return WorkerPipes(*ours), WorkerPipes(*theirs)

    def fds(self) -> list[int]:
        return list(astuple(self))

    def close(self) -> None:
        for fd in self.fds():
            os.close(fd)


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
        self._received, self._frames = bytearray(), collections.deque()
        self._readable = select.poll()
        self._readable.register(fd, select.POLLIN)

    def receive(self) -> Any:
        """The next object the launching process sent down (blocking), or None once it
        ended its side; OSError if the link broke."""
        while not self._frames:
            # Waits in poll(), not read(): Linux wakes a thread blocked in read() on a
            # stream socket each time the other side takes what this side wrote.
            self._readable.poll()
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return None
            self._received += chunk
            self._frames.extend(body for _, body in take_frames(self._received, _HEADER))
        return pickle.loads(self._frames.popleft())

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
            data = frame([event])
            self._write_pending()
            write_all(self._fd, data)

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
            write_all(self._fd, frame(pending))


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (blocking)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def frame(obj: Any) -> bytes:
    """`obj` as one frame of the link (either way)."""
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
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
        for _, body in take_frames(self._buffer, _HEADER):
            try:
                events.extend(pickle.loads(body))
            except Exception as error:  # noqa: BLE001 - e.g. a class this process lacks
                events.append(Unreadable(self.rank, f"{type(error).__name__}: {error}"))
        return events


def take_frames(buffer: bytearray, header: struct.Struct) -> list[tuple[tuple, bytes]]:
    """The whole frames at the start of `buffer`, taken out of it: each frame's header
    fields before its length (the header's last field), and its body."""
    frames, start = [], 0
    while len(buffer) - start >= header.size:
        *fields, length = header.unpack_from(buffer, start)
        end = start + header.size + length
        if len(buffer) < end:
            break
        frames.append((tuple(fields), bytes(buffer[start + header.size : end])))
        start = end
    del buffer[:start]
    return frames
