"""The launching process's side of a group of workers: start, watch, stop.

`WorkerGroupBase` handles what the workers send, wherever they run; `WorkerGroup`
runs them on this machine (a Ray cluster's group is launch/cluster/group.py). It
waits on one selector for everything a worker can do: write output, send an event
down its channel, or exit (its sentinel). Nothing blocks without a deadline, and
`stop()` always leaves no worker behind: SIGTERM, a short grace period, then
SIGKILL, as torch.distributed.elastic does. Each worker leads its own process
group, and `stop()` kills those groups too, so what a worker started goes with it;
a janitor process (launch/forking.py) does the same if this process dies.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import selectors
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from notebook_accel.launch.channel import ChannelReader, WorkerPipes, frame
from notebook_accel.launch.debugging import Answer, InputUnavailable, person_answers
from notebook_accel.launch.errors import WorkerError, WorkerFailure
from notebook_accel.launch.forking import (
    Janitor,
    StopOnInterrupt,
    close_parent_only,
    guarded,
    heap_frozen,
    interrupts_deferred,
    parent_only,
    parent_only_fds,
)
from notebook_accel.launch.fresh import FreshProcess, ship
from notebook_accel.launch.output_pipes import PYTHON_PIPE, FramedLines, StreamLines
from notebook_accel.launch.processes import (
    KILL_REAP_SECONDS,
    TERMINATE_GRACE_SECONDS,
    ForkedProcess,
    OtherProcess,
    end_processes,
    kill_group,
    of_each,
)
from notebook_accel.launch.stacks import STACK_SIGNAL, StackCapture, StacksNote, explain
from notebook_accel.launch.template import TemplateProcess

# Imported here, in the launching process, so that forked workers inherit the child's
# runtime and what it imports instead of each importing them again (milliseconds per worker).
from notebook_accel.launch.worker import WorkerSpec, worker_main
from notebook_accel.reporting.events import (
    InputRequested,
    OutputLine,
    RanksStuck,
    ResourceSample,
    RunEvent,
    Unreadable,
    WorkerExited,
    WorkerRaised,
)

# After the first failure, how long to keep listening so that the failure that
# caused the others (often a peer's "connection closed") can be told apart.
SETTLE_SECONDS = 0.25
# A worker that raised exits right after sending its error (launch/worker.py), but on a
# loaded machine, or with a stream slow to flush, that can outlast the settle period: its
# exit code belongs in the WorkerError, so the launcher waits for it this long at most.
RAISED_EXIT_SECONDS = 10.0
# How often the supervisor samples each worker's memory for live views, and
# looks for an exit its sentinel did not show.
RESOURCE_SAMPLE_SECONDS = 1.0
# How long an exiting worker may take to become reportable after its sentinel closed.
EXIT_STATUS_SECONDS = 1.0
# Stop pressed after this long without progress: the run was stuck, and the cell shows
# where each rank was before they are stopped.
STUCK_ON_STOP_SECONDS = 5.0
# How long the workers get to write their stacks, and how long after the last of them
# started the launcher keeps reading (a dump arrives in a few pipe reads).
STACKS_WAIT_SECONDS = 3.0
STACKS_SETTLE_SECONDS = 0.3
# How long a worker may take to read the answer to its own prompt.
ANSWER_WRITE_SECONDS = 5.0
# Why a worker's prompt got no answer where the group has no prompter.
NO_PROMPTER = "nobody can answer input here"

Emit = Callable[[RunEvent], None]


class StopSignal:
    """Lets another thread (a Stop button) end a run: `set()` wakes the launcher."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._set = False
        self._closed = False
        self._lock = threading.Lock()

    def set(self) -> None:
        """Ask the run to stop (once; later calls do nothing)."""
        with self._lock:
            self.set_from_signal_handler()

    def set_from_signal_handler(self) -> None:
        """`set()` without the lock, for a signal handler: the thread it interrupts
        may hold the lock. Such a handler is removed before `close()`."""
        if not self._set and not self._closed:
            self._set = True
            with contextlib.suppress(OSError):
                os.write(self._write, b"x")

    def is_set(self) -> bool:
        """Whether `set()` was called."""
        return self._set

    def fileno(self) -> int:
        """The file descriptor a selector waits on: readable once `set()` was called."""
        return self._read

    def close(self) -> None:
        """Release the pipe (once)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)


@contextlib.contextmanager
def interrupts_stop(stop: StopSignal | None) -> Iterator[StopSignal | None]:
    """While the block runs, a stop press (SIGINT) sets a StopSignal instead of raising.

    Yields `stop`, or in the main thread a new StopSignal when none was given.
    The launch raises KeyboardInterrupt itself once it sees the signal, and
    tears down with no interrupt able to cut that short; a press that the
    block did not turn into KeyboardInterrupt (during teardown, or after the
    workers finished) is raised at the end, and wins over another error. The
    previous handler is back in place when the block ends. Other threads
    cannot receive signals: they get `stop` as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    early: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: early.append(signum))
    catcher: StopOnInterrupt | None = None
    own = stop is None
    try:
        if own:
            stop = StopSignal()
        catcher = StopOnInterrupt(stop.set_from_signal_handler)
        signal.signal(signal.SIGINT, catcher)
        if early:
            catcher(signal.SIGINT, None)
        yield stop
    except BaseException as error:
        if catcher is not None and catcher.pressed and not isinstance(error, KeyboardInterrupt):
            raise KeyboardInterrupt("the run was stopped") from error
        raise
    finally:
        if own and stop is not None:  # while a press is still caught: raised, it could cut
            stop.close()  # the close between its two descriptors and leave one open
        signal.signal(signal.SIGINT, previous)
    if catcher.pressed or early:
        raise KeyboardInterrupt("the run was stopped")


@dataclass
class FatalReport:
    """The Python stacks a worker's faulthandler writes to stderr as it crashes: a worker
    killed by a fatal signal (SIGSEGV in a C extension) sends no exception, and these lines
    (from START to END) are its stack in the WorkerError."""

    START = "Fatal Python error:"
    END = "Extension modules:"
    MAX_LINES = 200
    lines: list[str] = field(default_factory=list)
    _open: bool = False

    def feed(self, line: str) -> None:
        """Look at one line of the worker's stderr."""
        if line.startswith(self.START):
            self.lines, self._open = [], True
        if line.startswith(self.END) or len(self.lines) >= self.MAX_LINES:
            self._open = False
        elif self._open:
            self.lines.append(line)


@dataclass
class SupervisedWorker:
    """What the launching process knows of one worker: its ranks, its process and how it ended."""

    rank: int
    local_rank: int
    # A multiprocessing process, a FreshProcess or a TemplateProcess here; what
    # stands for one elsewhere (a cluster's group keeps its own handle).
    process: Any
    error: WorkerRaised | None = None
    exitcode: int | None = None
    noticed_at: float = 0.0
    # Where it runs, for messages ("node 10.0.0.7 (3f2a9c01)"); empty on this machine.
    where: str = ""
    # Why it can no longer be reached (its node left the cluster); empty while it can.
    lost: str = ""
    # What faulthandler wrote to its stderr when it crashed (a fatal signal).
    fatal: FatalReport = field(default_factory=FatalReport)
    # Its Python stacks, when the launcher asked for them (launch/stacks.py).
    stacks: StackCapture = field(default_factory=StackCapture)
    # Stopped by the launcher while a peer was in its post-mortem debugger: a casualty.
    stopped_for_peer: bool = False

    @property
    def in_post_mortem(self) -> bool:
        """Whether it is in its post-mortem debugger (raised with post_mortem, not ended)."""
        return self.error is not None and self.error.post_mortem and not self.ended

    @property
    def ended(self) -> bool:
        """Whether it exited, or was lost."""
        return self.exitcode is not None or bool(self.lost)


@dataclass
class WorkerPipe:
    """This process's end of one of a worker's pipes (a field of WorkerPipes): its
    events, on the "channel", are read by `reader`."""

    worker: SupervisedWorker
    stream: str
    reader: ChannelReader | None = None
    lines: StreamLines | FramedLines = field(init=False)

    def __post_init__(self) -> None:
        self.lines = FramedLines() if self.stream == PYTHON_PIPE else StreamLines(self.stream)


class WorkerGroupBase:
    """What every group of workers does with what they send, wherever they run.

    Every event (a worker's output lines, what it sends down its channel,
    memory samples, exits) goes to `emit`, in the launching thread. A
    subclass starts and stops the workers, and delivers their bytes and exits
    in `poll_until`: output to `take`, exits to `exited`.
    """

    settle_seconds = SETTLE_SECONDS

    def __init__(self, spec: WorkerSpec, emit: Emit, stop: StopSignal | None = None):
        self.spec = spec
        self.emit = emit
        self.stop_signal = stop
        self.workers: list[SupervisedWorker] = []
        # After this many seconds without progress (no output, event or exit from any
        # worker) the cell shows where each rank is; None: never (launch option
        # explain_hang_after).
        self.hang_after: float | None = None
        self._progressed()
        # Asks for the line a worker's stdin reads (launch/debugging.py); None: nobody
        # can answer (NO_PROMPTER).
        self.prompter: Callable[[int, str, float | None], str] | None = None
        # Seconds a person spent at prompts since the loop last looked: they do not count
        # towards the run's timeout (an unattended prompter's do, and end at it).
        self._prompt_seconds = 0.0
        # The deadline of the wait in progress (None: none), for an unattended prompt.
        self._deadline: float | None = None
        # An unattended prompt waited out the launch's timeout (_answer_prompt).
        self._prompt_ran_out = False
        # Told the rank of each worker that exits with code 0: the process hosting the
        # launch's store marks it there, for peers still waiting to meet it.
        self.on_clean_exit: Callable[[int], None] | None = None

    # -- what a subclass provides --------------------------------------------------

    def start(self) -> None:
        """Start every worker of the group."""
        raise NotImplementedError

    def stop(self) -> None:
        """End every worker still running and release every resource (once)."""
        raise NotImplementedError

    def poll_until(self, until: float | None) -> None:
        """Handle what the workers do until `until` (at most a short while: the loop
        looks at its deadline and stop signal between calls)."""
        raise NotImplementedError

    def reap_unseen_exits(self) -> None:
        """Record exits that `poll_until` could not see (nothing to do by default)."""

    def _listening_to(self, stop: StopSignal) -> contextlib.AbstractContextManager:
        """While the block runs, `poll_until` also wakes when `stop` is set."""
        return contextlib.nullcontext()

    def signal(self, rank: int, signum: int) -> None:
        """Send `signum` to worker `rank` if it still runs."""
        raise NotImplementedError

    def send(self, rank: int, data: bytes, deadline: float) -> None:
        """Write the frame `data` (launch/channel.py) down worker `rank`'s link: a live
        call, or the answer to its prompt. TimeoutError if it does not take it before
        `deadline`, OSError if its link is gone."""
        raise NotImplementedError

    def end_calls(self) -> None:
        """End the launching process's side of every link: live workers then finish and
        exit (what they send still comes up)."""
        raise NotImplementedError

    def connection_addresses(self) -> list[tuple[str, int]]:
        """The local address of every TCP connection the workers hold (live workers
        break their connections to each other by these: live/regroup.py)."""
        raise NotImplementedError

    # -- watching --------------------------------------------------------------

    def wait(self, deadline: float | None) -> None:
        """Return when every worker has exited cleanly; raise WorkerError or TimeoutError.

        After the first failure it listens `settle_seconds` longer (or until
        every worker has exited), so that the failure that caused the others
        is reported first.
        """
        self.serve_until(self.all_exited, deadline, self.stop_signal, self.failed_workers)
        if failures := self.failed_workers():
            raise WorkerError(self._failures_cause_first(failures))

    def serve_until(
        self,
        done: Callable[[], bool],
        deadline: float | None,
        stop: StopSignal | None,
        failed: Callable[[], list[SupervisedWorker]] | None = None,
    ) -> None:
        """Handle the workers' events until `done()` is true.

        Raises WorkerError once `failed()` (by default: a worker raised or
        exited at all, as live workers only exit when told to) has named a
        worker for `settle_seconds`, TimeoutError at `deadline`, and
        KeyboardInterrupt once `stop` is set.
        """
        failed = failed or self._ended_workers
        self._prompt_ran_out = False
        self._progressed()  # a wait starts: what came before (an idle live group) is no hang
        with self._listening_to(stop) if stop is not None else contextlib.nullcontext():
            settle_until: float | None = None
            while not done():
                if settle_until is not None and self._settled(settle_until):
                    raise WorkerError(self._failures_cause_first(failed()))
                if settle_until is None and deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError
                if stop is not None and stop.is_set():
                    self._explain_if_stuck()
                    raise KeyboardInterrupt("the run was stopped")
                self._deadline = deadline
                wake = settle_until  # the settle period ends, then the wait for a raised exit
                if settle_until is not None and time.monotonic() >= settle_until:
                    wake = settle_until + RAISED_EXIT_SECONDS
                self.poll_until(until=self._hang_due(wake or deadline))
                self.reap_unseen_exits()
                if self._prompt_ran_out and settle_until is None:
                    # Its worker, answered, may finish before the loop looks at the clock
                    # again: the timeout that ended the prompt ends the run now (on a
                    # loaded machine the run otherwise returned, its timeout passed).
                    raise TimeoutError
                if deadline is not None:
                    deadline += self._prompt_seconds
                self._prompt_seconds = 0.0
                # A worker in its post-mortem debugger ends when the user is done with it.
                debugging = any(worker.in_post_mortem for worker in self.workers)
                if settle_until is None and failed() and not debugging:
                    settle_until = time.monotonic() + self.settle_seconds
                self._explain_if_hung()

    def _settled(self, settle_until: float) -> bool:
        """Whether the failures are all in: the settle period is over, and every worker
        that raised has exited (or RAISED_EXIT_SECONDS more have passed)."""
        now = time.monotonic()
        if now < settle_until:
            return False
        # One in its post-mortem debugger is not exiting: it ends when the user is done.
        exiting = any(
            w.error is not None and not w.ended and not w.in_post_mortem for w in self.workers
        )
        return not exiting or now >= settle_until + RAISED_EXIT_SECONDS

    # -- a run that makes no progress ------------------------------------------------

    def _progressed(self) -> None:
        self._last_progress = time.monotonic()
        self._hang_explained = False

    def _hang_due(self, until: float | None) -> float | None:
        """`until`, or sooner if the hang explanation falls due before it."""
        if self.hang_after is None or self._hang_explained:
            return until
        due = self._last_progress + self.hang_after
        return due if until is None else min(until, due)

    def _explain_if_hung(self) -> None:
        due = self._hang_due(None)
        if due is not None and time.monotonic() >= due:
            self._hang_explained = True  # once per stall: any progress re-arms it
            self.explain_where(
                f"no progress for {self.hang_after:g} s (no output, step or event from any "
                "worker); the run goes on (explain_hang_after= sets when this is shown)"
            )

    def _explain_if_stuck(self) -> None:
        stalled = time.monotonic() - self._last_progress
        if stalled >= STUCK_ON_STOP_SECONDS:
            self.explain_where(
                f"Stop pressed after {stalled:.0f} s without progress; before "
                "the workers are stopped"
            )

    def explain_where(self, reason: str) -> None:
        """Ask every running worker for its Python stacks and show where each rank is
        (an event the cell prints)."""
        asked = [w for w in self.workers if not w.ended]
        if not asked:
            return
        for worker in asked:
            worker.stacks.expect()
            self.signal(worker.rank, STACK_SIGNAL)
        deadline = time.monotonic() + STACKS_WAIT_SECONDS
        while time.monotonic() < deadline:
            # Each worker's dump, and its note (a worker that holds the GIL sends none:
            # it is shown from its stack alone, after STACKS_WAIT_SECONDS).
            if all((w.stacks.threads and w.stacks.note) or w.ended for w in asked):
                deadline = min(deadline, time.monotonic() + STACKS_SETTLE_SECONDS)
            self.poll_until(until=min(deadline, time.monotonic() + 0.05))
        stacks = {w.rank: w.stacks.finish() for w in asked if not w.ended}
        ended = {
            w.rank: "finished (exited with code 0)"
            if w.exitcode == 0 and w.error is None and not w.lost
            else _failure_of(w).how
            for w in self.workers
            if w.ended
        }
        all_reducing = [
            w.rank for w in asked if w.stacks.note and w.stacks.note.gradient_all_reduce
        ]
        self.emit(RanksStuck(explain(reason, stacks, ended, all_reducing)))

    def take(self, pipe: WorkerPipe, data: bytes) -> None:
        """Turn `data`, read from `pipe`, into events (its channel) or output lines."""
        if pipe.reader is not None:
            for event in pipe.reader.feed(data):
                if isinstance(event, StacksNote):  # asked for by explain_where: no progress
                    pipe.worker.stacks.note = event
                    continue
                self._progressed()
                self.on_event(pipe.worker, event)
        else:
            self.emit_lines(pipe.worker, pipe.lines.feed(data))

    def emit_lines(self, worker: SupervisedWorker, lines: list[tuple[str, str]]) -> None:
        """Emit (stream, line) pairs of `worker`'s output."""
        for stream, line in lines:
            if stream == "stderr":
                if worker.stacks.take(line):  # asked for: shown in the explanation
                    continue
                worker.fatal.feed(line)
            self._progressed()
            self.emit(OutputLine(worker.rank, stream, line))

    def on_event(self, worker: SupervisedWorker, event: RunEvent) -> None:
        """Act on an event `worker` sent (answer its prompt, stop its peers), then emit it."""
        if isinstance(event, Unreadable):  # the worker runs on, but its event is lost: stop
            event = WorkerRaised(
                worker.rank,
                exception="UnpicklingError: the launching process could not read what the "
                f"worker sent back ({event.reason}); return plain data (tensors, numbers, "
                "strings)",
                traceback="",
                time=time.time(),
            )
        if isinstance(event, InputRequested):
            self._answer_prompt(worker)
            return
        if isinstance(event, WorkerRaised):
            worker.error = event
            if event.post_mortem:
                self._stop_others_for(worker)
        self.emit(event)

    # -- prompts and debuggers in a worker (launch/debugging.py) --------------------------

    def _answer_prompt(self, worker: SupervisedWorker) -> None:
        """Ask in the cell for the line `worker` waits for, and send it back."""
        prompt = self.take_prompt(worker)
        started = time.monotonic()
        line, reason, pressed, shown = None, NO_PROMPTER, False, False
        attended = self.prompter is None or person_answers()
        # A peer failed first: this run is ending, and this rank's prompt (often its
        # post-mortem of a collective the failed rank left) is not worth the user's time.
        # The peers the launcher stopped for a post-mortem are its consequence, not a cause.
        failed_first = next(
            (w for w in self.failed_workers() if w is not worker and not w.stopped_for_peer),
            None,
        )
        try:
            if failed_first is not None:
                reason = f"the run is ending: rank {failed_first.rank} failed first"
            elif self.prompter is not None:
                line = self.prompter(worker.rank, prompt, None if attended else self._deadline)
        except InputUnavailable as why:
            reason, shown = str(why), why.shown
            self._prompt_ran_out = self._deadline is not None and (
                not attended and time.monotonic() >= self._deadline
            )
        except KeyboardInterrupt:
            reason, pressed = "the run was stopped", True
        finally:
            if attended:
                self._prompt_seconds += time.monotonic() - started
            self._progressed()
        if line is None and prompt and not shown:  # not asked: the text stays in the output
            self.emit(OutputLine(worker.rank, "stdout", prompt + "\n"))
        with contextlib.suppress(OSError, TimeoutError):  # it is gone: its read fails
            deadline = time.monotonic() + ANSWER_WRITE_SECONDS
            self.send(worker.rank, frame(Answer(line, reason)), deadline)
        if pressed:
            if self.stop_signal is None:
                raise KeyboardInterrupt("the run was stopped")
            self.stop_signal.set()

    def take_prompt(self, worker: SupervisedWorker) -> str:
        """What `worker` wrote before its prompt (shown first), and the prompt itself."""
        return ""

    def _stop_others_for(self, worker: SupervisedWorker) -> None:
        """`worker` opens its post-mortem debugger: end the other workers now, as a
        failure would; it ends when the user is done with it. A peer that raised first is
        left alone: it ends on its own (its exit may not be noticed yet), and it was no
        consequence of this one."""
        for other in self.workers:
            if other is worker or other.ended or other.stopped_for_peer or other.error is not None:
                continue
            other.stopped_for_peer = True
            self.signal(other.rank, signal.SIGTERM)

    def exited(self, worker: SupervisedWorker, exitcode: int | None, lost: str = "") -> None:
        """Record that `worker` exited with `exitcode` (or was lost, saying why), once
        everything it wrote before has been taken."""
        worker.exitcode, worker.lost = exitcode, lost
        worker.noticed_at = time.time()
        self._progressed()
        if exitcode == 0 and not lost and self.on_clean_exit is not None:
            self.on_clean_exit(worker.rank)
        self.emit(WorkerExited(worker.rank, exitcode))

    def failed_workers(self) -> list[SupervisedWorker]:
        """The workers that raised, exited with a non-zero code or a signal, or were lost."""
        return [w for w in self.workers if w.error is not None or w.exitcode or w.lost]

    @staticmethod
    def _failures_cause_first(workers: list[SupervisedWorker]) -> list[WorkerFailure]:
        # A worker that died without raising (a signal, os._exit, a lost node) cannot
        # be a casualty of a peer's Python exception; among the ones that raised, the
        # earliest raised first and the rest saw its connection close.
        # Those the launcher stopped for a peer's post-mortem debugger come last.
        def order(worker: SupervisedWorker) -> tuple[int, float]:
            if worker.error is not None:
                return (1, worker.error.time)
            return (2 if worker.stopped_for_peer else 0, worker.noticed_at)

        return [_failure_of(worker) for worker in sorted(workers, key=order)]

    def _ended_workers(self) -> list[SupervisedWorker]:
        return [w for w in self.workers if w.error is not None or w.ended]

    def poll(self) -> None:
        """Handle what the workers did since the last look (output, events, exits),
        without waiting: a live group looks for a worker that died between calls."""
        self.poll_until(until=time.monotonic())
        self.reap_unseen_exits()

    def all_exited(self) -> bool:
        """Whether every worker has exited (or was lost)."""
        return all(worker.ended for worker in self.workers)


class WorkerGroup(WorkerGroupBase):
    """The workers of one launch attempt on this machine: processes it forks or starts.

    Workers close every descriptor registered with `forking.parent_only`.
    `local_ranks` chooses which of the node's local ranks this group starts
    (all by default; a cluster node's agent starts the one it stands for).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        emit: Emit,
        stop: StopSignal | None = None,
        local_ranks: Sequence[int] | None = None,
    ):
        super().__init__(spec, emit, stop)
        self.local_ranks = range(spec.local_world_size) if local_ranks is None else local_ranks
        self._selector = selectors.DefaultSelector()
        self._next_sample = 0.0
        self._next_exit_check = 0.0
        self._pipes: dict[int, WorkerPipe] = {}
        self._sentinels: dict[int, SupervisedWorker] = {}
        self._stopped = False
        self._janitor = Janitor()

    # -- starting --------------------------------------------------------------

    def start(self) -> None:
        """Fork the janitor, then start one worker per local rank."""
        # An interrupt between a start and the bookkeeping would leave a worker
        # that stop() does not know about: it waits until every worker is known.
        # The fork lock keeps another launch's thread out of store creation and
        # name lookups while these forks copy the process.
        with guarded(), heap_frozen():
            self._janitor.start()
            spec_fd = None
            if self.spec.start_method in ("spawn", "forkserver"):
                # A fresh interpreter per worker, or forked from the template (started once).
                start = FreshProcess if self.spec.start_method == "spawn" else TemplateProcess
                spec_fd = ship(self.spec)  # pickled once, read by every worker
                make = functools.partial(start, spec_fd)
            else:

                def make(local_rank: int, pipes: WorkerPipes, name: str) -> ForkedProcess:
                    # The child must hold no read end of any pipe (its own, those of the
                    # workers started before it, those of another launch), nor a socket or
                    # janitor pipe of this process.
                    args = (self.spec, local_rank, pipes, parent_only_fds(), os.getpid())
                    return ForkedProcess(target=worker_main, args=args, name=name, daemon=False)

            try:
                for local_rank in self.local_ranks:
                    self._start_one(make, local_rank)
            finally:
                if spec_fd is not None:
                    os.close(spec_fd)

    def _start_one(self, make: Callable[..., Any], local_rank: int) -> None:
        ours, theirs = WorkerPipes.open()
        for fd in ours.fds():
            parent_only(fd)
        process = make(local_rank, theirs, name=f"notebook_accel-worker-{local_rank}")
        try:
            process.start()
        except BaseException:
            for fd in ours.fds():
                close_parent_only(fd)
            raise
        finally:
            theirs.close()
        # The worker makes itself a group leader too; both, so that neither order wins a race.
        with contextlib.suppress(OSError):
            os.setpgid(process.pid, process.pid)
        self._janitor.watch(process.pid)
        worker = SupervisedWorker(self.spec.global_rank(local_rank), local_rank, process)
        self.workers.append(worker)
        for stream, fd in asdict(ours).items():
            reader = ChannelReader(worker.rank) if fd == ours.channel else None
            os.set_blocking(fd, False)
            self._pipes[fd] = WorkerPipe(worker, stream, reader)
            self._selector.register(fd, selectors.EVENT_READ)
        self._sentinels[process.sentinel] = worker
        self._selector.register(process.sentinel, selectors.EVENT_READ)

    # -- watching --------------------------------------------------------------

    def poll_until(self, until: float | None) -> None:
        """Handle what happens until `until` or the next memory sample, whichever is first."""
        wake_at = self._next_sample if until is None else min(until, self._next_sample)
        for key, _ in self._selector.select(max(0.0, wake_at - time.monotonic())):
            # An fd may have been closed earlier in the same batch of events.
            if key.fd in self._sentinels:
                self._selector.unregister(key.fd)
                self._on_exit(self._sentinels.pop(key.fd))
            elif key.fd in self._pipes:
                self._drain(key.fd)
        if time.monotonic() >= self._next_sample:
            self._sample_resources()

    def reap_unseen_exits(self) -> None:
        """Exits whose sentinel never became readable (a process forked elsewhere
        while the sentinel pipe was being made holds its write end): asked of the
        operating system, at most once per sample period."""
        if time.monotonic() < self._next_exit_check:
            return
        self._next_exit_check = time.monotonic() + RESOURCE_SAMPLE_SECONDS
        for worker in self.workers:
            if worker.exitcode is None and worker.process.exitcode is not None:
                for fd in [fd for fd, owner in self._sentinels.items() if owner is worker]:
                    self._selector.unregister(fd)
                    del self._sentinels[fd]
                self._on_exit(worker)

    def _sample_resources(self) -> None:
        self._next_sample = time.monotonic() + RESOURCE_SAMPLE_SECONDS
        for worker in self.workers:
            with contextlib.suppress(psutil.Error):
                if worker.exitcode is None:
                    rss = psutil.Process(worker.process.pid).memory_info().rss
                    self.emit(ResourceSample(worker.rank, rss))

    def _drain(self, fd: int, last: bool = False) -> None:
        """Read what the pipe holds now; at its end, or when `last`, close it.

        The one reader of every pipe: while the run goes, when a worker has
        exited (what it wrote before is already in the pipe), and at teardown.
        """
        pipe = self._pipes[fd]
        while True:
            try:
                data = read_some(fd)
            except BlockingIOError:  # nothing more for now
                if last:
                    self._close(fd)
                return
            if not data:  # every writer is gone
                self._close(fd)
                return
            self.take(pipe, data)

    def _close(self, fd: int) -> None:
        pipe = self._pipes.pop(fd)
        self._selector.unregister(fd)
        close_parent_only(fd)
        self.emit_lines(pipe.worker, pipe.lines.flush())  # a last line without a newline

    def _on_exit(self, worker: SupervisedWorker) -> None:
        # The sentinel closes while the process exits, a moment before waitpid can
        # report it (Process.join then returns with no exit code): wait for that
        # moment. If it has not come within EXIT_STATUS_SECONDS, the next
        # reap_unseen_exits records the exit instead of the run waiting forever.
        deadline = time.monotonic() + EXIT_STATUS_SECONDS
        while worker.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)
        if worker.process.exitcode is not None:
            self.drain_output(worker, channel=True)
            self.exited(worker, worker.process.exitcode)

    def drain_output(
        self, worker: SupervisedWorker, channel: bool = False, last: bool = False
    ) -> list[WorkerPipe]:
        """Take what `worker`'s output pipes (and its channel, if `channel`) hold now;
        return those pipes. `last`: close them too (`_drain`)."""
        pipes = {
            fd: p
            for fd, p in self._pipes.items()
            if p.worker is worker and (channel or p.stream != "channel")
        }
        for fd in pipes:
            self._drain(fd, last)
        return list(pipes.values())

    def take_prompt(self, worker: SupervisedWorker) -> str:
        return "".join(p.lines.take_partial("stdout") for p in self.drain_output(worker))

    def send(self, rank: int, data: bytes, deadline: float) -> None:
        write_before(self.link_fd(rank), data, deadline)

    def link_fd(self, rank: int) -> int:
        """This process's end of worker `rank`'s link; OSError once it is closed."""
        for fd, pipe in self._pipes.items():
            if pipe.worker.rank == rank and pipe.stream == "channel":
                return fd
        raise OSError(f"the link to worker rank {rank} is closed")

    @contextlib.contextmanager
    def _listening_to(self, stop: StopSignal) -> Iterator[None]:
        self._selector.register(stop.fileno(), selectors.EVENT_READ)
        try:
            yield
        finally:
            self._selector.unregister(stop.fileno())

    def connection_addresses(self) -> list[tuple[str, int]]:
        return connection_addresses([worker.process.pid for worker in self.workers])

    def end_calls(self) -> None:
        for fd, pipe in self._pipes.items():
            if pipe.stream == "channel":
                link = socket.socket(fileno=fd)
                try:
                    with contextlib.suppress(OSError):  # the worker is gone
                        link.shutdown(socket.SHUT_WR)
                finally:
                    link.detach()

    def signal(self, rank: int, signum: int) -> None:
        for worker in self.workers:
            if worker.rank == rank:
                worker.process.kill(signum)

    # -- stopping --------------------------------------------------------------

    def stop(self) -> None:
        with interrupts_deferred():
            if not self._stopped:
                self._terminate()
                self._stopped = True

    def _terminate(self) -> None:
        alive = [w for w in self.workers if w.process.exitcode is None]
        # Listed before the workers go: their children are re-parented after.
        # (Those in a worker's process group go with it; this finds the ones
        # that left it, started while the worker ran.)
        descendants = of_each([w.process.pid for w in alive], lambda p: p.children(recursive=True))
        end_processes([w.process for w in alive], TERMINATE_GRACE_SECONDS, KILL_REAP_SECONDS)
        # What the workers started, including the children of a worker that
        # exited by itself (re-parented, but still in its process group).
        for worker in self.workers:
            kill_group(worker.process.pid, signal.SIGKILL)
        end_processes(map(OtherProcess, descendants), grace=0, reap=0, groups=False)
        try:  # every worker's exit code and last output; then close the processes and pipes
            for worker in self.workers:
                if worker.exitcode is None:
                    worker.exitcode = worker.process.exitcode
                self.drain_output(worker, channel=True, last=True)
                if worker.process.exitcode is not None:
                    worker.process.close()
            for fd in list(self._pipes):  # none should be left; close them all the same
                self._close(fd)
        finally:  # whatever reading the last output raised, nothing of the run stays
            self._janitor.close()
            self._selector.close()


def read_some(fd: int) -> bytes:
    """What `fd` holds, up to 64 KiB; b"" at its end, or where a worker's channel (a socket)
    was reset, by a worker that ended before it read what was sent to it (the answer to a
    prompt where Stop was pressed): once what it sent before is read."""
    try:
        return os.read(fd, 1 << 16)
    except ConnectionResetError:
        return b""


def _failure_of(worker: SupervisedWorker) -> WorkerFailure:
    return WorkerFailure(
        rank=worker.rank,
        exitcode=worker.exitcode,
        traceback=worker.error.traceback if worker.error else "".join(worker.fatal.lines),
        exception=worker.error.exception if worker.error else "",
        where=worker.where,
        lost=worker.lost,
    )


def write_before(fd: int, data: bytes, deadline: float) -> None:
    """Write all of `data` to non-blocking `fd`; TimeoutError if not taken by `deadline`."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:  # its reader is behind: wait until it takes some
            if (remaining := deadline - time.monotonic()) <= 0:
                raise TimeoutError("the worker did not read what was sent down its link") from None
            writable = select.poll()  # select() takes no descriptor above 1023
            writable.register(fd, select.POLLOUT)
            writable.poll(remaining * 1000)


def connection_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """The local address of every TCP connection the processes `pids` hold."""
    connections = of_each(pids, lambda process: process.net_connections("tcp"))
    return sorted({(c.laddr.ip, c.laddr.port) for c in connections})
