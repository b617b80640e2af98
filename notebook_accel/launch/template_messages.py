"""The messages between the kernel (launch/template.py) and its template process
(launch/template_server.py): one JSON object per SOCK_SEQPACKET message, with file
descriptors attached (SCM_RIGHTS). Both sides send and receive them here.
"""

from __future__ import annotations

import array
import json
import os
import socket
from collections.abc import Iterable

# Once its socket is closed, how long the template gets to exit before SIGKILL
# (and, in the template, its workers to be reaped).
EXIT_SECONDS = 5.0
# What one message may hold: its bytes, and descriptors attached.
_MESSAGE_BYTES = 1 << 20
_MAX_FDS = 8
_RECEIVE_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def send(sock: socket.socket, message: dict, fds: Iterable[int] = (), flags: int = 0) -> None:
    """One message with `fds` attached (socket.send_fds, which drops `flags` in 3.11)."""
    fds = array.array("i", fds)
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)] if fds else []
    sock.sendmsg([json.dumps(message).encode()], ancillary, flags)


def receive(sock: socket.socket) -> tuple[list[tuple[dict, list[int]]], bool]:
    """The messages waiting on `sock`, each with its descriptors, without waiting for
    more; and whether the other end has closed (socket.recv_fds drops the flags in 3.11)."""
    received = []
    while True:
        fds = array.array("i")
        try:
            data, ancillary, _, _ = sock.recvmsg(
                _MESSAGE_BYTES, socket.CMSG_LEN(_MAX_FDS * fds.itemsize), _RECEIVE_FLAGS
            )
        except BlockingIOError:
            return received, False
        except OSError:  # closed or reset
            return received, True
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        if not data:  # the other end closed
            close_all(fds)
            return received, True
        received.append((json.loads(data), list(fds)))


def close_all(fds: Iterable[int]) -> None:
    """Close every descriptor of `fds`."""
    for fd in fds:
        os.close(fd)
