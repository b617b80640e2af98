"""What the kernel sends a live worker: one call at a time, down the worker's own pipe.

A frame is a pickled `Call` behind an 8-byte length. The function, its
arguments or a cell's source travel inside it by value (cloudpickle, as for
workers in fresh interpreters: a function defined after the workers started
exists only in the kernel). What comes back goes down the worker's event
channel as a `CallFinished` (reporting/events.py), its value packed by
live/values.py.

Besides the user's calls, the kernel sends two of its own (live/regroup.py):
"break" (every worker shuts down its connections to the others, at once,
even in the middle of a call) and "regroup" (every worker forms the process
group again, then answers). The group writes each frame where its worker
reads it: into the pipe here, through the node's agent on a cluster.
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass

_HEADER = struct.Struct("<Q")


@dataclass(frozen=True)
class Call:
    """One request to every chosen rank: run a function, or a cell's source."""

    call_id: int
    # "function": `payload` is (function, args, kwargs) pickled by value;
    # "cell": `payload` is the cell's source, utf-8;
    # "break": `payload` is the local addresses of the workers' TCP connections,
    # pickled (no answer);
    # "regroup": `payload` is the new group's generation number, as text.
    kind: str
    payload: bytes
    ranks: tuple[int, ...]
    # Every chosen rank sends its value back, not only the first chosen one.
    return_all: bool = False
    # The name tracebacks give a cell's code ("<cell 3 on workers>").
    filename: str = "<cell on workers>"


def encode(call: Call) -> bytes:
    """`call` as the frame a worker's command pipe carries (the group writes it)."""
    body = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def read_call(fd: int) -> Call | None:
    """The next call from the kernel (blocking), or None when the kernel closed the pipe."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _read_exactly(fd, length)
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks, wanted = [], size
    while wanted:
        try:
            chunk = os.read(fd, min(wanted, 1 << 20))
        except InterruptedError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        wanted -= len(chunk)
    return b"".join(chunks)
