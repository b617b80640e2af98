"""A detached run on a Ray cluster: its keeper is a detached actor of the cluster.

The kernel that launches with `cluster="ray"` and `detach=True` creates the
run's keeper as a detached Ray actor (it outlives the kernel's Ray job) in a
namespace of the user's own, and returns at once. The actor runs the launch
as the kernel would (`run_plan`, its agents and placement group its own: they
go with it) and keeps the run's events, bounded as a run directory's log is
(log.py). Any kernel connected to the cluster finds it by name, reads the
events since the last it had, and can stop it. After the run ends the actor
stays `KEEP_ENDED_SECONDS` for kernels that come for the outcome, or until a
kernel calls `forget()`; a kernel that stops a run frees it at once.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import threading
import time
from typing import Any

from notebook_accel.launch.cluster.connect import connect, require_ray
from notebook_accel.launch.cluster.pool import AGENT_RUNTIME_ENV
from notebook_accel.launch.running import run_plan
from notebook_accel.launch.runs.detached import DetachedRun
from notebook_accel.launch.runs.directory import CLUSTER_ID_PREFIX, RunRecord, new_run_id
from notebook_accel.launch.runs.log import decode, encode, kept_after_compaction
from notebook_accel.launch.runs.starting import plan_bytes, plan_from_bytes
from notebook_accel.launch.supervisor import StopSignal
from notebook_accel.reporting.events import CheckpointSaved, RunEnded, RunEvent
from notebook_accel.reporting.observers import RunObserver
from notebook_accel.reporting.report import final_status

# A cluster run's id starts so: attach() and runs() know where to look for it.
ID_PREFIX = CLUSTER_ID_PREFIX
ACTOR_PREFIX = "notebook_accel-run-"
# How long an ended run's keeper waits for a kernel to come for the outcome.
KEEP_ENDED_SECONDS = 3600.0
# Events a keeper holds before it keeps only what a view shows (log.py's compaction).
KEPT_EVENTS = 20_000
# The longest a kernel waits for one answer of the keeper before taking it as gone.
ANSWER_SECONDS = 30.0


def runs_namespace() -> str:
    """The Ray namespace of this user's detached runs: another user's kernels, which
    name their own, do not list or reach them by name."""
    return f"notebook_accel_runs_{getpass.getuser()}"


class _Collector(RunObserver):
    def __init__(self, keeper: ClusterKeeper) -> None:
        self.keeper = keeper

    def on_event(self, event: RunEvent, report: Any) -> None:
        if not isinstance(event, RunEnded):  # the keeper adds it once the record says so
            self.keeper._append(event)


class ClusterKeeper:
    """Runs on the cluster as a detached Ray actor (`ray.remote(ClusterKeeper)`): one
    detached run, started when the actor is, and its events."""

    def __init__(self, record: RunRecord, launch: bytes) -> None:
        from notebook_accel.launch.cluster.group import import_what_a_run_uses

        import_what_a_run_uses()  # here, not on the run's thread (see that function)
        self._record = record
        self._entries: list[tuple[int, bytes]] = []
        self._events: list[tuple[int, RunEvent]] = []
        self._sequence = 0
        self._limit = KEPT_EVENTS
        self._lock = threading.Lock()
        self._stop = StopSignal()
        self._launch = launch
        threading.Thread(target=self._run, name="notebook_accel-run", daemon=True).start()

    def _run(self) -> None:
        ended, status = RunEnded(RuntimeError("the run could not start")), "failed"
        try:
            plan = plan_from_bytes(self._launch)
            # The actor is inside the cluster: it uses its own connection; the pool goes as
            # soon as the run ends (nothing launches after it from here).
            request = dataclasses.replace(plan.cluster, address=None, keep_warm=0.0)
            plan = dataclasses.replace(plan, cluster=request, warm=False)
            report = plan.new_report(started_at=self._record.created)
            with self._lock:
                self._record.state = "running"
            run_plan(plan, _Collector(self), stop=self._stop, report=report)
            ended, status = RunEnded(None), "finished"
        except BaseException as error:  # noqa: BLE001 - the outcome the kernels get
            ended, status = RunEnded(error), final_status(error)
        with self._lock:
            self._record.state = status
            self._record.ended = ended.time
            self._record.error = None if ended.error is None else str(ended.error)[:500]
        self._append(ended)
        time.sleep(KEEP_ENDED_SECONDS)
        os._exit(0)  # nobody came for the outcome: the actor ends

    def _append(self, event: RunEvent) -> None:
        with self._lock:
            self._sequence += 1
            self._events.append((self._sequence, event))
            self._entries.append((self._sequence, encode(self._sequence, event)))
            if isinstance(event, CheckpointSaved):
                self._record.checkpoint = event.path
            if len(self._entries) > self._limit:
                self._events = kept_after_compaction(self._events)
                kept = {sequence for sequence, _ in self._events}
                self._entries = [entry for entry in self._entries if entry[0] in kept]
                self._limit = max(KEPT_EVENTS, 2 * len(self._entries))

    # -- what kernels call ---------------------------------------------------------

    def read(self, after: int) -> bytes:
        """The records of the events after sequence number `after`."""
        with self._lock:
            return b"".join(record for sequence, record in self._entries if sequence > after)

    def record(self) -> RunRecord:
        """The run's record: what was launched, its state, its newest checkpoint."""
        with self._lock:
            return dataclasses.replace(self._record)

    def stop(self) -> None:
        """Stop the run: every worker, agent and the placement group go."""
        self._stop.set()

    def launch(self) -> bytes:
        """The launch as it was shipped (starting.plan_bytes), for `resume`."""
        return self._launch


class ClusterRun(DetachedRun):
    """A detached run whose keeper is a detached actor of a Ray cluster (`ClusterKeeper`)."""

    def __init__(self, record: RunRecord, actor: Any, launch: bytes | None = None) -> None:
        super().__init__(record)
        self._actor = actor
        self._last = 0
        # The launch, where this kernel started the run: it resumes a run whose keeper died.
        self._launch = launch

    def _ask(self, call: Any) -> Any:
        ray = require_ray()
        return ray.get(call, timeout=ANSWER_SECONDS)

    def _read_new(self) -> list[tuple[int, Any]]:
        ray = require_ray()
        try:
            data = self._ask(self._actor.read.remote(self._last))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return []
        found = [(sequence, event) for sequence, event in decode(data) if sequence > self._last]
        if found:
            self._last = found[-1][0]
        return found

    def _keeper_gone(self) -> bool:
        ray = require_ray()
        try:
            self.record = self._ask(self._actor.record.remote())
        except ray.exceptions.RayActorError:
            return True
        return False

    def _on_lost(self) -> str:
        return "its Ray actor died"

    def _state_now(self) -> str:
        return "lost" if self._keeper_gone() else self.record.state

    def _ask_to_stop(self) -> bool:
        ray = require_ray()
        try:
            self._ask(self._actor.stop.remote())
        except ray.exceptions.RayActorError:
            return False
        return True

    def _after_stop(self, seconds: float) -> None:
        self.forget()  # whoever stopped it has its outcome

    def forget(self) -> None:
        """End the run's keeper actor now (a running run with it): what it kept is gone."""
        ray = require_ray()
        ray.kill(self._actor, no_restart=True)

    def _relaunch(self, checkpoint: str | None) -> DetachedRun:
        ray = require_ray()
        launch = self._launch
        if launch is None:
            try:
                launch = self._ask(self._actor.launch.remote())
            except ray.exceptions.RayActorError:
                raise RuntimeError(
                    f"run {self.id}'s keeper died, and its launch with it: only the kernel "
                    "that started the run can resume it. Launch the function again with "
                    f"detach=True and have it load the checkpoint ({checkpoint or 'none'})"
                ) from None
        plan = plan_from_bytes(launch)
        plan = dataclasses.replace(plan, resume_from=checkpoint or plan.resume_from)
        return start_on_cluster(plan, resumed_from=self.id)


def start_on_cluster(plan: Any, resumed_from: str | None = None) -> ClusterRun:
    """Start a checked cluster launch under a detached keeper actor; return at once.
    `resumed_from`: the run it goes on from (at `plan.resume_from`, its checkpoint)."""
    ray = require_ray()
    connect(plan.cluster.address)
    record = RunRecord(
        id=ID_PREFIX + new_run_id(),
        function=getattr(plan.function, "__qualname__", repr(plan.function)),
        created=time.time(),
        world_size=plan.world_size,
        main_rank=0,
        local_world_size=plan.world_size,
        return_all=plan.return_all,
        output=plan.output,
        backend=plan.settings.backend,
        mixed_precision=plan.settings.mixed_precision,
        start_method="on the cluster",
        checkpoint=plan.resume_from,
        resumed_from=resumed_from,
    )
    launch = plan_bytes(plan)
    actor = (
        ray.remote(ClusterKeeper)
        .options(
            name=ACTOR_PREFIX + record.id,
            namespace=runs_namespace(),
            lifetime="detached",
            num_cpus=0,
            max_concurrency=4,
            runtime_env=AGENT_RUNTIME_ENV,
        )
        .remote(record, launch)
    )
    return ClusterRun(record, actor, launch)


def cluster_runs(address: str | None = None) -> list[ClusterRun]:
    """This user's detached runs on the cluster (connecting to it first), oldest first."""
    ray = require_ray()
    if address is None and not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        # connect() would start a new cluster of this machine, which holds no run.
        raise ConnectionError(
            "this kernel is not connected to a Ray cluster: pass ray_address= (the "
            "cluster's address, as the launch had it) to attach() or runs(), or call "
            "ray.init(address=...) first"
        )
    connect(address)
    found = []
    namespace = runs_namespace()
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != namespace or not entry["name"].startswith(ACTOR_PREFIX):
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace=namespace)
            record = ray.get(actor.record.remote(), timeout=ANSWER_SECONDS)
        except Exception:  # noqa: BLE001 - an actor that just ended is not listed
            continue
        found.append(ClusterRun(record, actor))
    return sorted(found, key=lambda run: run.record.created)


def find_cluster_run(run_id: str | None, address: str | None = None) -> ClusterRun:
    """The cluster run `run_id` (or a unique prefix of it), or the newest."""
    found = cluster_runs(address)
    if run_id is not None:
        found = [run for run in found if run.id.startswith(run_id)]
    if not found or (run_id is not None and len(found) > 1):
        what = "no detached run" if not found else f"{run_id!r} names several runs"
        raise LookupError(f"{what} on the Ray cluster{f' ({run_id!r})' if run_id else ''}")
    return found[-1]
