"""Where this user's detached runs live, and each run's record.

Every run has a directory of its own under `runs_root()`: its record
(`run.json`: what was launched, the keeper process that owns it, its state),
its event log (log.py), the shipped function and options (`plan.pickle`, for
`resume`) and the keeper's own output (`keeper.log`). The root and every run
directory are private to the user (mode 0700): another user can neither read
a run nor reach its keeper; stopping a run is a signal to its keeper, which the
system allows only to the same user.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import secrets
import stat
import time
from pathlib import Path
from typing import Any

import cloudpickle
import psutil

from notebook_accel.launch.packing import pack, unpack
from notebook_accel.launch.processes import OtherProcess

# The prefix of a run on a Ray cluster's id (runs/on_cluster.py), whose keeper is not here.
CLUSTER_ID_PREFIX = "ray-"
# Where runs live; unset: $XDG_STATE_HOME/notebook_accel/runs (~/.local/state/...).
ENV_RUNS_DIR = "NOTEBOOK_ACCEL_RUNS_DIR"
RECORD_FILE = "run.json"
PLAN_FILE = "plan.pickle"
KEEPER_LOG = "keeper.log"

# A run's state: "starting" until its keeper runs it, "running", then one of the
# final states of a launch's report, or "lost" when its keeper died before the end.
ENDED_STATES = ("finished", "failed", "stopped", "timed out", "lost")


def runs_root() -> Path:
    """The directory holding this user's runs, created private (0700) if missing.

    Raises PermissionError if it exists but another user owns it or others may
    read it: a run's output and results are the user's alone.
    """
    if configured := os.environ.get(ENV_RUNS_DIR):
        root = Path(configured).expanduser()
    else:
        state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
        root = Path(state) / "notebook_accel" / "runs"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = root.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{root} belongs to another user; detached runs must be private. Set "
            f"${ENV_RUNS_DIR} to a directory of your own."
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        root.chmod(0o700)
    return root


def open_private(path: Path, append: bool = False) -> int:
    """A file only its user may read (0600), whatever the umask: emptied, or appended to."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write_private(path: Path, data: bytes) -> None:
    """Replace `path` whole with `data`, a private file: a reader sees the old or the new."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with os.fdopen(open_private(partial), "wb") as file:
        file.write(data)
    os.replace(partial, path)


def plan_bytes(plan: Any) -> bytes:
    """The launch, as a keeper will run it: the function and its arguments by value (a
    notebook cell's function works, as in fresh workers), the options as checked."""
    shipped = pack(plan.function, plan.args, plan.kwargs)
    options = dataclasses.replace(plan, function=None, args=(), kwargs={})
    return pickle.dumps((cloudpickle.dumps(options, protocol=5), shipped))


def plan_from_bytes(data: bytes) -> Any:
    """The plan `plan_bytes` packed, its function and arguments unpacked."""
    options, shipped = pickle.loads(data)
    function, args, kwargs = unpack(shipped)
    return dataclasses.replace(
        cloudpickle.loads(options), function=function, args=args, kwargs=kwargs
    )


@dataclasses.dataclass
class RunRecord:
    """What `run.json` says of a run: what was launched and by which process.

    `keeper_pid` and `keeper_started` (its start time, as the system reports it)
    name the keeper process; together they cannot name another process that
    reused the PID. `checkpoint` is the newest checkpoint the run saved.
    """

    id: str
    function: str
    created: float
    state: str = "starting"
    keeper_pid: int | None = None
    keeper_started: float | None = None
    world_size: int = 0
    main_rank: int = 0
    local_world_size: int = 0
    return_all: bool = False
    output: str = "all"
    backend: str = ""
    mixed_precision: str = "no"
    start_method: str = ""
    checkpoint: str | None = None
    resumed_from: str | None = None
    ended: float | None = None
    error: str | None = None

    @property
    def ended_state(self) -> bool:
        return self.state in ENDED_STATES

    @classmethod
    def of_plan(cls, plan: Any, prefix: str = "", **fields: Any) -> RunRecord:
        """The first record of a new run of the checked launch `plan`, its id `prefix`,
        when it started and six hex digits that tell two of a second apart; `fields` are
        what differs from what the plan says (where the keeper runs, the run it resumes)."""
        run_id = prefix + time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
        shape = {"main_rank": plan.node_rank * plan.local_world_size}
        shape.update(local_world_size=plan.local_world_size, start_method=plan.start_method)
        return cls(
            run_id,
            getattr(plan.function, "__qualname__", repr(plan.function)),
            time.time(),
            world_size=plan.world_size,
            return_all=plan.return_all,
            output=plan.output,
            backend=plan.settings.backend,
            mixed_precision=plan.settings.mixed_precision,
            checkpoint=plan.resume_from,
            **{**shape, **fields},
        )


class RunDirectory:
    """One run's directory: its record, event log, shipped plan and keeper log."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, plan: Any, **fields: Any) -> RunDirectory:
        """A new private run directory under `runs_root()`, with the first record of a
        run of `plan` (`RunRecord.of_plan`) and the launch for its keeper and `resume`."""
        record = RunRecord.of_plan(plan, **fields)
        directory = cls(runs_root() / record.id)
        directory.path.mkdir(mode=0o700)
        directory.write(record)
        write_private(directory.path / PLAN_FILE, plan_bytes(plan))
        return directory

    def read(self) -> RunRecord:
        """The record as last written (each write replaces the file whole)."""
        data = json.loads((self.path / RECORD_FILE).read_text())
        known = {field.name for field in dataclasses.fields(RunRecord)}
        return RunRecord(**{name: value for name, value in data.items() if name in known})

    def write(self, record: RunRecord) -> None:
        text = json.dumps(dataclasses.asdict(record), indent=1)
        write_private(self.path / RECORD_FILE, text.encode())

    def read_plan(self) -> Any:
        return plan_from_bytes((self.path / PLAN_FILE).read_bytes())

    def update(self, **changes: Any) -> RunRecord:
        """Change fields of the record (only one process writes it at a time: the
        kernel until the keeper runs, then the keeper)."""
        record = dataclasses.replace(self.read(), **changes)
        self.write(record)
        return record

    def keeper(self, record: RunRecord | None = None) -> OtherProcess | None:
        """The handle on the run's keeper process if it still runs, else None."""
        record = record or self.read()
        if record.keeper_pid is None:
            return None
        try:
            process = psutil.Process(record.keeper_pid)
            same = abs(process.create_time() - (record.keeper_started or 0.0)) < 0.5
            alive = process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return None
        return OtherProcess(process) if same and alive else None

    def state(self, record: RunRecord | None = None) -> str:
        """The run's state, as `record` (read now if None) says; "lost" if its keeper died first."""
        record = record or self.read()
        if record.ended_state or record.keeper_pid is None or self.keeper(record) is not None:
            return record.state
        return "lost"

    def keeper_log_tail(self, lines: int = 20) -> str:
        """The last lines the keeper process wrote (its own errors)."""
        with contextlib.suppress(OSError):
            return "\n".join((self.path / KEEPER_LOG).read_text().splitlines()[-lines:])
        return ""


def run_directories() -> list[RunDirectory]:
    """This user's runs, the oldest first."""
    found = []
    for path in runs_root().iterdir():
        directory = RunDirectory(path)
        with contextlib.suppress(OSError, ValueError, TypeError):  # not a run's, or half made
            found.append((directory.read().created, directory))
    return [directory for _, directory in sorted(found, key=lambda pair: pair[0])]


def find_run(run_id: str | None = None) -> RunDirectory:
    """The run `run_id` (or a unique prefix of it), or the newest run."""
    found = run_directories()
    if not found:
        raise LookupError(
            f"no detached run in {runs_root()}: start one with notebook_launcher(..., detach=True)"
        )
    if run_id is None:
        return found[-1]
    matching = [directory for directory in found if directory.path.name.startswith(run_id)]
    if len(matching) == 1:
        return matching[0]
    known = ", ".join(directory.path.name for directory in found[-5:])
    if not matching:
        raise LookupError(f"no run {run_id!r}; the newest are: {known} (runs() lists them all)")
    raise LookupError(f"{run_id!r} names several runs; give more of the id. The newest: {known}")
