"""A worker's output, from its pipes to whole lines in the order it was written.

A worker has three output pipes. File descriptors 1 and 2 are two of them: what
C code, faulthandler and child processes write there arrives as it is, one pipe
per stream. Python's `sys.stdout` and `sys.stderr` (print, logging, warnings)
share the third: each write goes down it as frames of at most PIPE_BUF bytes,
each naming its stream. Two pipes cannot keep the order of writes across them
(the launcher reads whichever it gets to first, and may find a whole run's
output in both), so a warning printed after a line would be shown before it;
one pipe keeps it. A frame is written with one `write` call, which POSIX makes
atomic on a pipe at that size, so the threads of a worker and the processes it
forks (a DataLoader's workers) can share the pipe without mixing frames.
`sys.stdout.fileno()` stays 1 (and stderr's 2): what writes to the descriptor
itself (faulthandler, a subprocess given `sys.stdout`) writes unframed bytes
to its own pipe.
"""

from __future__ import annotations

import io
import os
import select
import struct

from notebook_accel.launch.channel import take_frames

# The shared pipe's name among a worker's pipes (the others: "stdout", "stderr", "channel").
PYTHON_PIPE = "python"

# A frame: its stream (the descriptor's number, 1 or 2) and the payload's length.
_FRAME_HEADER = struct.Struct("<BH")
MAX_FRAME_PAYLOAD = select.PIPE_BUF - _FRAME_HEADER.size
_STREAM_IDS = {"stdout": 1, "stderr": 2}


class _FramedStream(io.RawIOBase):
    """The bytes of one Python stream, written down the shared pipe in frames."""

    def __init__(self, pipe_fd: int, stream: str) -> None:
        super().__init__()
        self._pipe_fd = pipe_fd
        self._stream_id = _STREAM_IDS[stream]

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._stream_id  # fd 1 or 2: where writes below Python go

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        for start in range(0, len(view), MAX_FRAME_PAYLOAD):
            payload = view[start : start + MAX_FRAME_PAYLOAD]
            os.write(self._pipe_fd, _FRAME_HEADER.pack(self._stream_id, len(payload)) + payload)
        return len(view)


def python_streams(pipe_fd: int) -> tuple[io.TextIOWrapper, io.TextIOWrapper]:
    """New `sys.stdout` and `sys.stderr` for a worker, writing to the shared pipe."""
    return tuple(  # type: ignore[return-value]
        io.TextIOWrapper(
            _FramedStream(pipe_fd, stream),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,
            write_through=True,
        )
        for stream in _STREAM_IDS
    )


class StreamLines:
    """The launcher's lines of one of a worker's descriptors (1 or 2): (stream, line) pairs."""

    def __init__(self, stream: str) -> None:
        self.stream = stream
        self._pending = b""

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        """Take the next bytes; return the lines they complete (newline included)."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        return [(self.stream, line.decode(errors="replace") + "\n") for line in lines]

    def take_partial(self, stream: str) -> str:
        """The partial last line of `stream` (a prompt is stdout's), taken out."""
        if stream != self.stream:
            return ""
        rest, self._pending = self._pending, b""
        return rest.decode(errors="replace")

    def flush(self) -> list[tuple[str, str]]:
        """The partial last line, if any, with a newline added."""
        rest = self.take_partial(self.stream)
        return [(self.stream, rest + "\n")] if rest else []


class FramedLines:
    """The lines of a worker's shared pipe, both streams in the order they were written."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._lines = {number: StreamLines(name) for name, number in _STREAM_IDS.items()}

    def feed(self, data: bytes) -> list[tuple[str, str]]:
        """Take the next bytes; return the lines the whole frames among them complete."""
        self._buffer += data
        lines: list[tuple[str, str]] = []
        for (stream_id,), payload in take_frames(self._buffer, _FRAME_HEADER):
            lines += self._lines[stream_id].feed(payload)
        return lines

    def take_partial(self, stream: str) -> str:
        """The partial last line of `stream` (a prompt is stdout's), taken out."""
        return self._lines[_STREAM_IDS[stream]].take_partial(stream)

    def flush(self) -> list[tuple[str, str]]:
        """Each stream's partial last line, if any, with a newline added."""
        return [line for lines in self._lines.values() for line in lines.flush()]
