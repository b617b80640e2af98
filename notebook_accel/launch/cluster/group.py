"""The kernel's side of workers on a Ray cluster: one more WorkerGroupBase.

A launch (or a live group) with `cluster="ray"` opens its attempt here
instead of on this machine (launch/attempt.py); everything above the group
(the launcher, restarts, the reporting events, the views and the panel, live
calls) is the same code as for local workers. The workers' agents come from
a pool (pool.py): rank 0's agent binds the store on its node, then every agent
forks its worker with the rank's environment (MASTER_ADDR is rank 0's node).
The function and its arguments travel once, by value, through Ray's object
store. Nothing connects back to the kernel: only the kernel reaches the
cluster, so Ray Client (`ray://`) works too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from notebook_accel.launch.channel import ChannelReader, WorkerPipes
from notebook_accel.launch.cluster.connect import connect, require_ray
from notebook_accel.launch.cluster.pool import (
    AGENT_START_SECONDS,
    WAIT_SLICE_SECONDS,
    Place,
    WorkerPool,
    node_lost,
    return_pool,
    take_pool,
    wait_for,
)
from notebook_accel.launch.cluster.request import ClusterRequest
from notebook_accel.launch.errors import WorkerError
from notebook_accel.launch.forking import interrupts_deferred
from notebook_accel.launch.supervisor import (
    KILL_REAP_SECONDS,
    TERMINATE_GRACE_SECONDS,
    Emit,
    StopSignal,
    SupervisedWorker,
    WorkerGroupBase,
    WorkerPipe,
)
from notebook_accel.launch.worker import WorkerSpec
from notebook_accel.reporting.events import ModulesImported, RunEvent, WorkerExited

# How long one `events()` call may wait on its node for something to relay.
RELAY_SECONDS = 0.5
# How long the agents get to stop their workers and send their last output.
STOP_SECONDS = TERMINATE_GRACE_SECONDS + KILL_REAP_SECONDS + 2.0
# How long a live call's other orders (close, connections) get.
ORDER_SECONDS = 10.0
STREAMS = tuple(field.name for field in dataclasses.fields(WorkerPipes))
OUTPUT_STREAMS = tuple(stream for stream in STREAMS if stream != "channel")


class RayWorkerGroup(WorkerGroupBase):
    """The workers of one attempt, one per agent of `pool`."""

    # A lost node's agent is named a second or two after its peers see their
    # connections to it close: listen that long for it to be the cause.
    settle_seconds = 3.0

    def __init__(
        self,
        spec: WorkerSpec,
        emit: Emit,
        stop: StopSignal | None,
        pool: WorkerPool,
        rendezvous_timeout: float,
    ) -> None:
        super().__init__(spec, emit, stop)
        self.pool = pool
        self.rendezvous_timeout = rendezvous_timeout
        self._ray = require_ray()
        self._polls: dict[Any, SupervisedWorker] = {}
        self._pipes: dict[tuple[int, str], WorkerPipe] = {}
        self._imported: set[str] = set()  # the modules every agent was told to import
        self._stopped = False

    def start(self, interrupt: Callable[[], bool] | None = None) -> None:
        """Bind the store on rank 0's node, then fork every rank's worker."""
        ray = self._ray
        first = self.pool.agents[0].open_store.remote(self.rendezvous_timeout)
        [port] = wait_for([first], AGENT_START_SECONDS, interrupt)
        master = self.pool.places[0].info.address
        shipped = ray.put(self.spec.shipped)
        starts = {}
        for place, agent in zip(self.pool.places, self.pool.agents, strict=True):
            worker = SupervisedWorker(
                place.rank, place.local_rank, process=place, where=place.where
            )
            self.workers.append(worker)
            for stream in STREAMS:
                self._pipes[(place.rank, stream)] = WorkerPipe(worker, stream, reader=None)
            self._pipes[(place.rank, "channel")].reader = ChannelReader(place.rank)
            spec = self._spec_for(place, master, port)
            starts[agent.start.remote(spec, shipped, place.local_rank)] = worker
        failed, because = ray.exceptions.RayTaskError, "its agent could not start it"
        deadline = time.monotonic() + AGENT_START_SECONDS
        pending = list(starts)
        while pending and time.monotonic() < deadline:
            if interrupt is not None and interrupt():
                raise KeyboardInterrupt("the run was stopped")
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=WAIT_SLICE_SECONDS)
            for ref in ready:
                if self._answer(ref, starts[ref], failed, because) is not None:
                    self._relay(starts[ref])
        late = f"it did not start within {AGENT_START_SECONDS:.0f} s"
        for ref in pending:
            self._lose(starts[ref], None, because=late)

    def _spec_for(self, place: Place, master: str, port: int) -> WorkerSpec:
        environment = {
            **self.spec.environment,
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "LOCAL_WORLD_SIZE": str(place.local_world_size),
        }
        if place.node_gpu_ids:
            environment["CUDA_VISIBLE_DEVICES"] = ",".join(place.node_gpu_ids)
        return dataclasses.replace(
            self.spec,
            function=None,
            args=(),
            kwargs={},
            shipped=None,
            node_rank=place.node_index,
            local_world_size=place.local_world_size,
            first_rank=place.first_rank,
            main_rank=0,
            environment=environment,
            start_method="fork",
            own_main=True,
        )

    def poll_until(self, until: float | None) -> None:
        wait = WAIT_SLICE_SECONDS
        if until is not None:
            wait = max(0.0, min(wait, until - time.monotonic()))
        if not self._polls:
            time.sleep(wait)
            return
        ready, rest = self._ray.wait(list(self._polls), num_returns=1, timeout=wait)
        if ready and rest:
            more, _ = self._ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            worker = self._polls.pop(ref)
            self._deliver(ref, worker)
            if not worker.ended:
                self._relay(worker)

    def _answer(
        self, ref: Any, worker: SupervisedWorker, failed: type[Exception], because: str
    ) -> Any:
        """What `worker`'s agent answered to `ref`, or None with the worker lost (`_lose`)."""
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayActorError as error:
            self._lose(worker, error)
        except failed as error:
            self._lose(worker, error, because=because)
        return None

    def _relay(self, worker: SupervisedWorker) -> None:
        self._polls[self.pool.agents[worker.rank].events.remote(RELAY_SECONDS)] = worker

    def _deliver(self, ref: Any, worker: SupervisedWorker) -> None:
        """Take in what `worker`'s agent relayed in answer to `ref` (nothing if it was lost)."""
        relayed = self._answer(ref, worker, self._ray.exceptions.RayError, "its agent failed")
        for item in relayed or ():
            if isinstance(item, tuple):
                stream, data = item
                self.take(self._pipes[(worker.rank, stream)], data)
            elif isinstance(item, WorkerExited):
                if not worker.ended:
                    self._flush(worker)
                    self.exited(worker, item.exitcode)
            else:  # the agent's own events: memory samples
                self.emit(item)

    def on_event(self, worker: SupervisedWorker, event: RunEvent) -> None:
        # Every agent imports what a worker had to import itself (NodeAgent.warm) while the
        # workers train: one worker of each node reports, its peers import the same.
        if isinstance(event, ModulesImported):
            if new := [module for module in event.modules if module[0] not in self._imported]:
                self._imported.update(name for name, _ in new)
                for agent in self.pool.agents:
                    agent.warm.remote(new)
        super().on_event(worker, event)

    def _flush(self, worker: SupervisedWorker) -> None:
        for stream in OUTPUT_STREAMS:
            self.emit_lines(worker, self._pipes[(worker.rank, stream)].lines.flush())

    def _lose(
        self, worker: SupervisedWorker, error: BaseException | None, because: str = ""
    ) -> None:
        """`worker` ended without a word from it: `because` says why, followed by Ray's
        error; without `because`, its agent cannot be reached (its node left the
        cluster, most often), said in our words alone: Ray's text for that is about its
        actor's calls ("Connection reset by peer ... may or may not have been executed")."""
        if worker.ended:
            return
        if because:
            detail = _first_line(error)
            lost = f"{because} ({detail})" if detail else because
        else:
            lost = node_lost(worker.process.info.node_id)  # a Place
        self._flush(worker)
        self.exited(worker, None, lost=lost)

    def stop(self) -> None:
        """Have every agent end its worker; take their last output (once)."""
        with interrupts_deferred():
            if self._stopped:
                return
            self._stopped = True
            ray = self._ray
            stops = {self.pool.agents[w.rank].stop.remote(): w for w in self.workers if not w.lost}
            ready, unready = ray.wait(list(stops), num_returns=len(stops), timeout=STOP_SECONDS)
            for ref in ready:
                self._deliver(ref, stops[ref])
            late = f"its agent did not stop it within {STOP_SECONDS:.0f} s"
            for ref in unready:
                self._lose(stops[ref], None, because=late)
            for worker in self.workers:
                if not worker.ended:
                    self._flush(worker)
            self._polls.clear()

    # -- prompts in a worker (launch/debugging.py) ------------------------------------

    def take_prompt(self, worker: SupervisedWorker) -> str:
        # The agent relays a worker's output before what its channel sent after it.
        return "".join(
            self._pipes[(worker.rank, stream)].lines.take_partial("stdout")
            for stream in OUTPUT_STREAMS
        )

    # -- live workers ------------------------------------------------------------

    def signal(self, rank: int, signum: int) -> None:
        for worker in self.workers:
            if worker.rank == rank and not worker.ended:
                self.pool.agents[rank].signal.remote(signum)

    def send(self, rank: int, data: bytes, deadline: float) -> None:
        ray = self._ray
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the worker did not read what was sent down its link")
        ref = self.pool.agents[rank].send.remote(data, remaining)
        try:
            ray.get(ref, timeout=remaining + ORDER_SECONDS)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError("the worker's agent did not answer") from None
        except ray.exceptions.RayActorError as error:
            raise OSError(f"worker rank {rank}'s agent is gone ({_first_line(error)})") from None
        except ray.exceptions.RayError as error:
            if isinstance(getattr(error, "cause", None), TimeoutError):
                raise TimeoutError(str(error.cause)) from None
            raise OSError(_first_line(error)) from None

    def end_calls(self) -> None:
        refs = [self.pool.agents[w.rank].end_calls.remote() for w in self.workers if not w.lost]
        self._ray.wait(refs, num_returns=len(refs), timeout=ORDER_SECONDS)

    def connection_addresses(self) -> list[tuple[str, int]]:
        ray = self._ray
        refs = [self.pool.agents[w.rank].connections.remote() for w in self.workers if not w.lost]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ORDER_SECONDS)
        found: set[tuple[str, int]] = set()
        for ref in ready:
            with suppress(ray.exceptions.RayError):
                found.update(tuple(address) for address in ray.get(ref))
        return sorted(found)


@contextmanager
def open_cluster_group(
    request: ClusterRequest,
    spec: WorkerSpec,
    rendezvous_timeout: float,
    emit: Emit,
    stop: StopSignal | None,
    interrupt: StopSignal | None,
) -> Iterator[RayWorkerGroup]:
    """The workers of one attempt on the cluster, each started from `spec`; when the block
    ends, stopped, and their pool kept warm, or released when the run was stopped, timed
    out or lost a node."""
    asked_to_stop = interrupt.is_set if interrupt is not None else None
    connect(request.address)
    pool = take_pool(request, asked_to_stop)
    spec = dataclasses.replace(spec, shipped=request.shipped)
    group = RayWorkerGroup(spec, emit, stop, pool, rendezvous_timeout)
    keep = False
    try:
        group.start(asked_to_stop)
        yield group
        keep = True
    except WorkerError:
        keep = True  # the workers failed, not their agents: those serve the next run
        raise
    finally:
        group.stop()
        return_pool(pool, keep and not any(worker.lost for worker in group.workers))


def import_what_a_run_uses() -> None:
    """Import what a run on the cluster imports on first use, on the calling thread: a run
    started from the panel goes on in a thread of its own, where nothing may be imported
    (two threads importing one package tree are not safe)."""
    require_ray()
    import ray.util.placement_group  # noqa: F401
    import ray.util.scheduling_strategies  # noqa: F401


def _first_line(error: BaseException | None) -> str:
    if error is None:
        return ""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"[:300]
