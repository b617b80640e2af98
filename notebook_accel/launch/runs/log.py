"""A detached run's events, appended as they come and read back by any kernel.

The keeper keeps every event of the run (reporting/events.py) as a record: a
4-byte length, then the pickled (sequence number, event). On this machine it
appends each, in one `write`, to a segment file; a reader replays the events
in order, then follows the file (a record cut short, being written or by a
keeper killed mid-write, is read once whole, or never). A keeper on a Ray
cluster keeps the records in memory.

Bounded: past its size, the log keeps what a view needs (every metric, result
and exit, as a launch's report keeps them), but only each rank's newest output
lines (as many as the report keeps), progress and memory sample: the keeper
writes them to the next segment and removes the old one. Events keep their
sequence numbers, so a reader goes on in the new segment without seeing an
event twice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import struct
from collections import Counter
from pathlib import Path

import cloudpickle

from notebook_accel.launch.channel import take_frames
from notebook_accel.launch.runs.directory import open_private, write_private
from notebook_accel.reporting.events import OutputLine, Progress, ResourceSample, RunEvent
from notebook_accel.reporting.report import MAX_RANK_LINES

HEADER = struct.Struct("<I")
SEGMENT_BYTES = 8 * 2**20
_PREFIX, _SUFFIX = "events-", ".log"


def segment_path(directory: Path, number: int) -> Path:
    return directory / f"{_PREFIX}{number:06d}{_SUFFIX}"


def segments(directory: Path) -> list[int]:
    paths = directory.glob(f"{_PREFIX}*{_SUFFIX}")
    names = [path.name[len(_PREFIX) : -len(_SUFFIX)] for path in paths]
    return sorted(int(name) for name in names if name.isdecimal())


def encode(sequence: int, event: RunEvent) -> bytes:
    """One record. An event whose error cannot be pickled keeps its message instead."""
    try:
        payload = cloudpickle.dumps((sequence, event), protocol=5)
    except Exception:  # noqa: BLE001 - an error object of the user's that does not pickle
        error = getattr(event, "error", None)
        if not isinstance(error, BaseException):
            raise
        replaced = RuntimeError(f"{type(error).__name__}: {error}")
        payload = cloudpickle.dumps((sequence, dataclasses.replace(event, error=replaced)), 5)
    return HEADER.pack(len(payload)) + payload


def decode(data: bytes) -> tuple[list[tuple[int, RunEvent]], bytes]:
    """The (sequence number, event) of each whole record in `data`, in order, and what
    follows the last of them (a record still being written)."""
    rest = bytearray(data)
    return [pickle.loads(body) for _, body in take_frames(rest, HEADER)], bytes(rest)


def kept_after_compaction(entries: list[tuple]) -> list[tuple]:
    """The entries (sequence number, event, ...) a compacted log starts with (see above)."""
    lines_left: Counter = Counter()
    seen = set()  # (kind, rank) of the newest progress update and memory sample
    kept = []
    for entry in reversed(entries):
        event = entry[1]
        if isinstance(event, OutputLine):
            lines_left[event.rank] += 1
            if lines_left[event.rank] > MAX_RANK_LINES:
                continue
        elif isinstance(event, (Progress, ResourceSample)):
            if (type(event), event.rank) in seen:
                continue
            seen.add((type(event), event.rank))
        kept.append(entry)
    kept.reverse()
    return kept


class EventLog:
    """A run's events as numbered records, in memory, compacted past `limit` bytes."""

    def __init__(self, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.segment_bytes = segment_bytes
        self.limit = segment_bytes
        self.sequence = 0
        self.entries: list[tuple[int, RunEvent, bytes]] = []  # (sequence, event, record)
        self.size = 0

    def append(self, event: RunEvent) -> None:
        self.sequence += 1
        record = encode(self.sequence, event)
        self.entries.append((self.sequence, event, record))
        self.size += len(record)
        self._written(record)
        if self.size > self.limit:
            self.entries = kept_after_compaction(self.entries)
            self.size = sum(len(record) for _, _, record in self.entries)
            # What cannot be dropped (metrics) may fill a segment: leave room for as much again.
            self.limit = max(self.segment_bytes, 2 * self.size)
            self._compacted()

    def read(self, after: int = 0) -> bytes:
        """The records of the events after sequence number `after`."""
        return b"".join(record for sequence, _, record in self.entries if sequence > after)

    def _written(self, record: bytes) -> None: ...

    def _compacted(self) -> None: ...

    def close(self) -> None: ...


class EventLogWriter(EventLog):
    """A run's events, also appended to its directory's segments (in the keeper)."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES) -> None:
        super().__init__(segment_bytes)
        self.directory = directory
        self.number = 0
        self._fd = self._open(self.number)

    def _open(self, number: int) -> int:
        return open_private(segment_path(self.directory, number), append=True)

    def _written(self, record: bytes) -> None:
        os.write(self._fd, record)

    def _compacted(self) -> None:
        number = self.number + 1
        write_private(segment_path(self.directory, number), self.read())
        old, self._fd = self._fd, self._open(number)
        os.close(old)
        segment_path(self.directory, self.number).unlink(missing_ok=True)
        self.number = number

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)


class EventLogReader:
    """Reads a run's events in order, from the start, then as they are appended."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.last_sequence = 0
        self._file = None
        self._number = -1
        self._pending = b""

    def read_available(self) -> list[tuple[int, RunEvent]]:
        """Every whole event written since the last call (none: nothing new yet)."""
        found: list[tuple[int, RunEvent]] = []
        while True:
            if self._file is None and not self._open_newest():
                return found
            records, self._pending = decode(self._pending + self._file.read())
            found += [record for record in records if record[0] > self.last_sequence]
            if found:  # in sequence order, in a segment and from one to the next
                self.last_sequence = found[-1][0]
            if all(number <= self._number for number in segments(self.directory)):
                return found
            # The keeper moved on to a compacted segment holding everything kept so far.
            self._file.close()
            self._file, self._pending = None, b""

    def _open_newest(self) -> bool:
        for number in reversed(segments(self.directory)):
            with contextlib.suppress(FileNotFoundError):  # removed just now by a compaction
                self._file = open(segment_path(self.directory, number), "rb")  # noqa: SIM115
                self._number = number
                return True
        return False

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
