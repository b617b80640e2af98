"""The store the workers meet at, hosted by the process that starts them.

As torchrun's agent does, the launching process (the kernel on one machine,
the agent of rank 0's node on a cluster) hosts the `TCPStore` that
`init_process_group(init_method="env://")` connects to on every rank
(`TORCHELASTIC_USE_AGENT_STORE`), so a rank that dies before the rendezvous
cannot take the store with it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from notebook_accel.launch.forking import forget_parent_only, guarded, parent_only


@dataclass(eq=False)
class Rendezvous:
    """The store on a bound port: `with Rendezvous(...)`, fork the workers, `serve()`.

    The port is bound before the workers are forked, but the store's server
    thread starts only after they are: a thread running during a fork can hold
    a lock that the child then waits on forever (seen here as a worker stuck
    connecting to the store). Workers retry connecting until it answers.

    Binding, creating the store and destroying it take the fork lock (no
    other launch forks meanwhile) with interrupts held: a stop press lands
    before or after each step, never inside one. This object owns the
    listening socket and closes it once, in `__exit__`; the store gets a
    duplicate of it, which the store closes itself.

    `host` is the address the workers connect to; `bind_host` where the store
    listens ("" for every interface). With `hosts=False` (a machine other than
    the first) nothing is bound: that machine's workers reach the first's.
    """

    host: str
    port: int | None
    timeout: float
    bind_host: str | None = None
    hosts: bool = True
    # Workers are forked while it is open: list its descriptors for them to close.
    forks: bool = False
    _socket: socket.socket | None = field(default=None, init=False)
    _store: Any = field(default=None, init=False)
    _store_fd: int | None = field(default=None, init=False)

    @classmethod
    def for_plan(cls, plan: Any, forks: bool = False) -> Rendezvous:
        """The rendezvous of a launch plan on this machine (launch/preflight.py)."""
        return cls(
            plan.master_addr,
            plan.port,
            plan.rendezvous_timeout,
            # On one machine the store answers only there; across machines, on every
            # interface (the others reach it through master_addr).
            bind_host=plan.master_addr if plan.num_nodes == 1 else "",
            hosts=plan.node_rank == 0,
            forks=forks,
        )

    def __enter__(self) -> Rendezvous:
        if self.hosts:
            try:
                with guarded():
                    bind_host = self.host if self.bind_host is None else self.bind_host
                    self._socket = _listening_socket(bind_host, self.port)
                    if self.forks:
                        parent_only(self._socket.fileno())
                    self.port = self._socket.getsockname()[1]
            except BaseException:  # a with statement does not call __exit__ for this
                self.__exit__(None, None, None)
                raise
        return self

    def serve(self) -> None:
        """Start the store on the bound port (after the workers are forked)."""
        if self._socket is None or self._store is not None:
            return
        from datetime import timedelta

        import torch.distributed as dist

        with guarded():
            listen_fd = os.dup(self._socket.fileno())
            try:
                self._store = dist.TCPStore(
                    host_name=self.host,
                    port=self.port,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=self.timeout),
                    master_listen_fd=listen_fd,
                )
            except BaseException:
                _close_if_still_a_copy(listen_fd, self._socket)
                raise
            if self.forks:  # closed by the store; the workers of a later launch skip it
                self._store_fd = listen_fd
                parent_only(listen_fd)

    def mark_left(self, rank: int, attempt: int) -> None:
        """Mark at the store that `rank` exited cleanly: a peer still waiting to meet it
        there then fails at once (platforms/joining.py). Nothing once the store is gone."""
        if self._store is None:
            return
        import torch.distributed as dist

        from notebook_accel.platforms.joining import mark_left

        # A DistError: the store is going, and so is every rank that waited there.
        with contextlib.suppress(dist.DistError):
            mark_left(self._store, rank, attempt)

    def __exit__(self, *exc_info: Any) -> None:
        with guarded():
            self._store = None  # stops the server thread, which closes its descriptor
            if self._store_fd is not None:
                forget_parent_only(self._store_fd)
                self._store_fd = None
            if self._socket is not None:
                listener, self._socket = self._socket, None
                if self.forks:
                    forget_parent_only(listener.fileno())
                listener.close()


def _close_if_still_a_copy(fd: int, listener: socket.socket) -> None:
    """Close `fd`, the copy of `listener` handed to a store that failed, unless the
    store closed it already (the number may then name another file: left alone)."""
    try:
        mine, theirs = os.fstat(listener.fileno()), os.fstat(fd)
    except OSError:
        return
    if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
        os.close(fd)


def _listening_socket(host: str, port: int | None) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # Reuse a port whose last run's connections are still in TIME_WAIT; a port
    # another program listens on still fails to bind.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port or 0))
        listener.listen(1024)
    except OSError as error:
        listener.close()
        raise OSError(
            f"cannot listen on {host or 'this machine'} port {port} ({error.strerror}), so "
            "the workers cannot meet there: another run or program may be using it. On one "
            "machine leave use_port unset to pick a free port; otherwise choose another."
        ) from error
    return listener
