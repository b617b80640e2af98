"""A detached run on a Ray cluster: its keeper is a detached actor of the cluster.

The kernel that launches with `cluster="ray"` and `detach=True` creates the
run's keeper as a detached Ray actor (it outlives the kernel's Ray job) and
returns at once. The actor runs the launch as the kernel would (`run_plan`, its
agents and placement group its own: they go with it) and keeps the run's events,
bounded as a run directory's log is (log.py). Any kernel connected to the
cluster finds it by name, reads the events since the last it had, and can stop
it. After the run ends the actor waits a while for kernels that come for the
outcome (`KEEP_ENDED_SECONDS`).
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
from notebook_accel.launch.runs.detached import DetachedRun
from notebook_accel.launch.runs.directory import (
    CLUSTER_ID_PREFIX,
    RunRecord,
    plan_bytes,
    plan_from_bytes,
)
from notebook_accel.launch.runs.keeper import Keeper
from notebook_accel.launch.runs.log import EventLog, decode
from notebook_accel.launch.supervisor import StopSignal

ACTOR_PREFIX = "notebook_accel-run-"
KEEP_ENDED_SECONDS = 3600.0
# The longest a kernel waits for one answer of the keeper before taking it as gone.
ANSWER_SECONDS = 30.0


def runs_namespace() -> str:
    """The Ray namespace of this user's detached runs: another user's kernels, which
    name their own, do not list or reach them by name."""
    return f"notebook_accel_runs_{getpass.getuser()}"


class ClusterKeeper(Keeper):
    """Runs on the cluster as a detached Ray actor (`ray.remote(ClusterKeeper)`): one
    detached run, started when the actor is, its record and events in memory."""

    def __init__(self, record: RunRecord, launch: bytes) -> None:
        from notebook_accel.launch.cluster.group import import_what_a_run_uses

        import_what_a_run_uses()  # here, not on the run's thread (see that function)
        super().__init__(EventLog(), stop=StopSignal())
        self._record = record
        self._launch = launch
        threading.Thread(target=self._run, name="notebook_accel-run", daemon=True).start()

    def _run(self) -> None:
        self.keep(started_at=self._record.created)
        time.sleep(KEEP_ENDED_SECONDS)
        os._exit(0)  # nobody came for the outcome: the actor ends

    def plan(self) -> Any:
        plan = plan_from_bytes(self._launch)
        # The actor is inside the cluster: it uses its own connection; the pool goes as
        # soon as the run ends (nothing launches after it from here).
        request = dataclasses.replace(plan.cluster, address=None, keep_warm=0.0)
        return dataclasses.replace(plan, cluster=request)

    def update_record(self, **changes: Any) -> None:
        with self.lock:
            self._record = dataclasses.replace(self._record, **changes)

    # -- what kernels call ---------------------------------------------------------

    def read(self, after: int) -> bytes:
        with self.lock:
            return self.log.read(after)

    def record(self) -> RunRecord:
        """The run's record: what was launched, its state, its newest checkpoint."""
        return self._record  # replaced whole by each change, never changed in place

    def stop(self) -> None:
        """Stop the run: every worker, agent and the placement group go."""
        self.stop_signal.set()

    def launch(self) -> bytes:
        """The launch as it was shipped (directory.plan_bytes), for `resume`."""
        return self._launch


class ClusterRun(DetachedRun):
    """A detached run whose keeper is a detached actor of a Ray cluster (`ClusterKeeper`)."""

    def __init__(self, record: RunRecord, actor: Any, launch: bytes | None = None) -> None:
        super().__init__(record)
        self._actor = actor
        self._last = 0
        # The launch, where this kernel started the run: it resumes a run whose keeper died.
        self._launch = launch

    def _ask(self, method: str, *args: Any, gone: Any = None) -> Any:
        """The keeper actor's answer to `method(*args)`, or `gone` if the actor is gone."""
        ray = require_ray()
        try:
            return ray.get(getattr(self._actor, method).remote(*args), timeout=ANSWER_SECONDS)
        except ray.exceptions.RayActorError:
            return gone

    def read_new(self) -> list[tuple[int, Any]]:
        ray = require_ray()
        try:
            found, _ = decode(self._ask("read", self._last, gone=b""))  # those after `_last`
        except ray.exceptions.GetTimeoutError:
            return []
        if found:
            self._last = found[-1][0]
        return found

    def keeper_gone(self) -> bool:
        record = self._ask("record")
        self.record = record or self.record
        return record is None

    def on_lost(self) -> str:
        return "its Ray actor died"

    def ask_to_stop(self) -> bool:
        return self._ask("stop", gone=False) is None  # the actor's stop() says nothing

    def after_stop(self, seconds: float) -> None:
        self.forget()  # whoever stopped it has its outcome

    def forget(self) -> None:
        """End the run's keeper actor now (a running run with it): what it kept is gone."""
        require_ray().kill(self._actor, no_restart=True)

    def shipped_plan(self) -> Any:
        launch = self._launch or self._ask("launch")
        if launch is None:
            raise RuntimeError(
                f"run {self.id}'s keeper died, and its launch with it: only the kernel "
                "that started the run can resume it. Launch the function again with "
                "detach=True and have it load the checkpoint "
                f"({self.report.checkpoint or 'none'})"
            )
        return plan_from_bytes(launch)

    @classmethod
    def start(cls, plan: Any, resumed_from: str | None = None) -> ClusterRun:
        ray = require_ray()
        connect(plan.cluster.address)
        record = RunRecord.of_plan(
            plan,
            CLUSTER_ID_PREFIX,
            main_rank=0,
            local_world_size=plan.world_size,
            start_method="on the cluster",
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
        return cls(record, actor, launch)


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
    found = [run for run in cluster_runs(address) if run.id.startswith(run_id or "")]
    if not found:
        raise LookupError(f"no detached run on the Ray cluster{f' ({run_id!r})' if run_id else ''}")
    if run_id is not None and len(found) > 1:
        raise LookupError(f"{run_id!r} names several runs on the Ray cluster; give more of the id")
    return found[-1]
