"""The messages between the kernel (launch/template.py) and its template process
(launch/template_server.py): one JSON object per SOCK_SEQPACKET message, with file
descriptors attached (SCM_RIGHTS). Both sides send and receive them here.
"""

from __future__ import annotations

import array
import socket
from typing import Any

# Once its socket is closed, how long the template gets to exit before SIGKILL
# (and, in the template, its workers to be reaped).
EXIT_SECONDS = 5.0
# What one message may hold: its bytes, and descriptors attached.
MESSAGE_BYTES = 1 << 20
MAX_FDS = 8
RECEIVE_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def send_message(sock: socket.socket, data: list[bytes], fds: list[int], flags: int = 0) -> None:
    """One message with `fds` attached (socket.send_fds, which drops `flags` in 3.11)."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg(data, ancillary, flags)


def receive_message(
    sock: socket.socket, size: int, max_fds: int, flags: int
) -> tuple[bytes, list[int], int, Any]:
    """One message and the descriptors attached (socket.recv_fds, which drops `flags`
    in 3.11)."""
    fds = array.array("i")
    data, ancillary, msg_flags, address = sock.recvmsg(
        size, socket.CMSG_LEN(max_fds * fds.itemsize), flags
    )
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), msg_flags, address
