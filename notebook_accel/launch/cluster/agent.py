"""The agent: a Ray actor on a cluster node that runs one rank's worker process.

The agent (one per worker, placed by launch/cluster/pool.py) imports torch
and the worker's runtime once, when Ray starts it; each launch then forks the
worker from it, exactly as a launch on one machine forks from the kernel
(launch/supervisor.py's WorkerGroup, with launch/worker.py inside the child):
fast, and with nothing of an earlier run's process state. So the same agents
serve launch after launch (the pool keeps them warm), and a worker that is
stopped or killed takes nothing of the agent with it.

The agent parses nothing its worker writes: output and channel bytes are
relayed as they are, and the kernel turns them into lines and events
(WorkerGroupBase) as it does for its own workers. Values of classes defined
in the notebook exist only in the worker and the kernel, not in the agent.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from notebook_accel.launch.rendezvous import Rendezvous
from notebook_accel.launch.supervisor import (
    WorkerGroup,
    WorkerPipe,
    connection_addresses,
    write_before,
)

# Imported here once, so that every worker forked from the agent starts with it.
from notebook_accel.launch.worker import WorkerSpec
from notebook_accel.reporting.events import WorkerExited
from notebook_accel.reporting.report import Warming

# The longest one wait inside `events()` lasts before it looks at the clock again.
POLL_SLICE_SECONDS = 0.05
# Calls an agent takes at once: the kernel's events() and stop, signal or a live call.
MAX_CONCURRENT_CALLS = 8


@dataclass(frozen=True)
class AgentInfo:
    """Where Ray started an agent: its node, its address there, and the GPUs it holds."""

    node_id: str
    address: str
    gpu_ids: tuple[str, ...] = ()


class NodeAgent:
    """Runs on a node as a Ray actor (`ray.remote(NodeAgent)`): one rank's worker at a time."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._outbox: list[Any] = []
        self._group: _RelayGroup | None = None
        self._rendezvous: Rendezvous | None = None

    def describe(self) -> AgentInfo:
        import ray

        context = ray.get_runtime_context()
        return AgentInfo(
            node_id=context.get_node_id(),
            address=ray.util.get_node_ip_address(),
            gpu_ids=tuple(str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])),
        )

    def ping(self) -> bool:
        """True: the agent is up (the kernel asks before reusing it)."""
        return True

    def open_store(self, timeout: float) -> int:
        """Bind the store's port on this node's address (rank 0's agent) and return it; the
        store itself starts once this agent's worker is forked (`start`)."""
        import ray

        with self._lock:
            self._close_store()
            address = ray.util.get_node_ip_address()
            self._rendezvous = Rendezvous(address, None, timeout, forks=True).__enter__()
            return int(self._rendezvous.port)

    def start(self, spec: WorkerSpec, shipped: bytes, local_rank: int) -> int:
        """Fork the worker of `local_rank` from `spec` (the function and its arguments
        in `shipped`); return its process id."""
        with self._lock:
            self._end_group()
            environment = {**spec.environment, **_loopback_interfaces(spec.environment)}
            spec = dataclasses.replace(spec, shipped=shipped, environment=environment)
            self._outbox.clear()
            self._group = _RelayGroup(spec, self._outbox.append, local_ranks=[local_rank])
            self._group.start()
            if self._rendezvous is not None:
                self._rendezvous.serve()
            return int(self._group.workers[0].process.pid)

    def events(self, seconds: float) -> list[Any]:
        """What the worker did since the last call: `(stream, bytes)` for its output
        and channel, then events (memory samples, its exit). Waits up to `seconds`
        for something to say."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                group = self._group
                if group is None:
                    return []
                if not group.all_exited():
                    group.poll_until(until=min(deadline, time.monotonic() + POLL_SLICE_SECONDS))
                    group.reap_unseen_exits()
                if self._outbox or group.all_exited() or time.monotonic() >= deadline:
                    return self._take_outbox()

    def signal(self, signum: int) -> None:
        with self._lock:
            group = self._group
            if group is not None and group.workers:
                group.signal(group.workers[0].rank, signum)

    def send(self, data: bytes, seconds: float) -> None:
        """Write a frame down the worker's link (a live call, the answer to its prompt);
        TimeoutError if the worker does not take it within `seconds`."""
        with self._lock:
            group = self._group
            if group is None or not group.workers:
                raise OSError("this agent runs no worker")
            fd = group.link_fd(group.workers[0].rank)
        write_before(fd, data, time.monotonic() + seconds)

    def end_calls(self) -> None:
        """End the kernel's side of the worker's link: a live worker then finishes and
        exits."""
        with self._lock:
            if self._group is not None:
                self._group.end_calls()

    def connections(self) -> list[tuple[str, int]]:
        """The local addresses of the worker's TCP connections (live/regroup.py)."""
        with self._lock:
            group = self._group
            pids = [w.process.pid for w in group.workers] if group is not None else []
        return connection_addresses(pids)

    def stop(self) -> list[Any]:
        """End the worker (SIGTERM, then SIGKILL) and close the store; return what the
        worker wrote last, and its exit."""
        with self._lock:
            self._end_group()
            self._close_store()
            return self._take_outbox()

    def warm(self, modules: list[tuple[str, str | None]]) -> list[str]:
        """Import here the safe modules a worker had to import itself (launch/warm.py),
        so that the next launch's worker starts with them; return what was imported."""
        from notebook_accel.launch.warm import RunWarmer

        warming = Warming()
        warmer = RunWarmer(warming, enabled=True, here=True)
        warmer.offer(modules)
        # Each import takes the fork lock: no worker is forked from a half-done import.
        warmer.drain()
        return list(warming.modules)

    def _take_outbox(self) -> list[Any]:
        relayed = list(self._outbox)
        self._outbox.clear()  # the group appends to this list
        return relayed

    def _end_group(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.stop()
            if not group.reported_exit:
                self._outbox.extend(WorkerExited(w.rank, w.exitcode) for w in group.workers)

    def _close_store(self) -> None:
        rendezvous, self._rendezvous = self._rendezvous, None
        if rendezvous is not None:
            rendezvous.__exit__(None, None, None)


class _RelayGroup(WorkerGroup):
    """The agent's one worker: its bytes go to the kernel as they are."""

    reported_exit = False

    def take(self, pipe: WorkerPipe, data: bytes) -> None:
        if pipe.stream == "channel":
            # What the worker wrote before it sent this goes first: the kernel takes a
            # prompt's text from the end of its stdout (launch/debugging.py).
            self.drain_output(pipe.worker)
        self.emit((pipe.stream, data))

    def exited(self, worker: Any, exitcode: int | None, lost: str = "") -> None:
        self.reported_exit = True
        super().exited(worker, exitcode, lost)


def _loopback_interfaces(environment: dict[str, str]) -> dict[str, str]:
    """When every worker meets on a loopback address (a cluster on one machine), the
    collectives' own connections stay on the loopback interface too."""
    if not _is_loopback(environment.get("MASTER_ADDR", "")):
        return {}
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(_is_loopback(address.address) for address in addresses):
            return {
                variable: os.environ.get(variable, name)
                for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
            }
    return {}


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False
