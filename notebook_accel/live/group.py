"""Live workers: a process group that stays up between cells.

`start_workers(...)` starts one worker per device, as a launch does (the
launcher's options, its checks, its supervisor, forked or in fresh
interpreters), but each worker then waits for calls instead of running one
function and exiting. `workers.run(fn, *args)` and the `%%on_workers` cell
magic run code on every worker (or chosen ranks), each in its own persistent
namespace, and return real objects (tensors moved to the CPU).

- Output streams into the calling cell, rank-prefixed, as for launches;
  `accelerator.log` feeds a live view under the cell and `workers.report`
  (the metric history continues across calls).
- The stop button (or a call's `timeout`) interrupts the call on every worker
  and leaves the workers alive with their state; a second press, or a worker
  that does not stop within `STOP_GRACE_SECONDS`, ends the group and says so.
- An exception in the called code raises WorkerError in the cell; the workers
  stay up. When one rank fails while others are still in the call (waiting
  in a collective for it, most often), they are interrupted and their
  connections broken at once, the process group is formed again, and the
  group goes on (live/regroup.py).
- A value that cannot come back shows as its repr from the worker
  (live/values.py); the group goes on.
- A worker that dies, during a call or between calls, ends the group with a
  WorkerError that names it; `workers.restart()` starts a new group in one
  call. The kernel's restart or death ends the workers (as for launches: they
  die with it).
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from notebook_accel.launch.attempt import open_group
from notebook_accel.launch.channel import frame
from notebook_accel.launch.errors import WorkerError, WorkerFailure
from notebook_accel.launch.plan import LaunchPlan
from notebook_accel.launch.supervisor import StopSignal, WorkerGroupBase, interrupts_stop
from notebook_accel.live.serve import Call
from notebook_accel.live.values import unpack
from notebook_accel.reporting.events import CallFinished, MetricRecord, Progress, RunEvent
from notebook_accel.reporting.observers import ConsoleObserver, RunFeed, RunObserver

if TYPE_CHECKING:
    from notebook_accel.launch.packing import SentValues

# After a stop press (or a timeout), how long the workers get to end the call.
STOP_GRACE_SECONDS = 5.0
# After a stop press, how long before the workers still in the call are taken out of
# any collective (a worker that does not check for stops is interrupted after 2 s).
BREAK_AFTER_SECONDS = 3.0
# After one rank failed, how long the others get to end the call by themselves
# before they are interrupted and taken out of any collective.
FAILURE_SETTLE_SECONDS = 0.25
# How long the workers get to form their process group again.
REGROUP_SECONDS = 60.0
# How long to wait for a worker's exit to be seen once its link broke.
EXIT_NOTICE_SECONDS = 3.0
# How long the workers get to start and join their process group.
START_SECONDS = 120.0
# How long a worker may take to read its next call before it counts as stuck.
SEND_SECONDS = 30.0
# How long the workers get to exit when the group is closed.
CLOSE_SECONDS = 5.0


RESTART = "workers.restart() starts a new group (the workers' state is gone)."


class GroupEnded(RuntimeError):
    """The live group is not running (it was closed, or a worker died); `restart()` it."""


class LiveWorkers:
    """A running group of live workers (see the module docstring). Use `start_workers`."""

    def __init__(
        self,
        plan: LaunchPlan,
        observers: list[RunObserver] | None = None,
        live: bool | None = None,
    ) -> None:
        self.plan = plan
        self.call_timeout = plan.timeout
        self.report = plan.new_report()
        main_rank = plan.node_rank * plan.local_world_size
        self.ranks = list(range(main_rank, main_rank + plan.local_world_size))
        self._observers = [ConsoleObserver(plan.output, main_rank=main_rank), *(observers or [])]
        self._feed = RunFeed(self.report, self._observers)
        self._live = live
        self._call_view: RunObserver | None = None  # among the observers while a call runs
        self._group: WorkerGroupBase | None = None
        self._opened: contextlib.ExitStack | None = None
        self._ids = itertools.count(1)
        # the notebook's values as the workers last got them (launch/packing.py)
        self._sent: SentValues | None = None
        self._finished: dict[int, dict[int, CallFinished]] = {}
        self._ended_because = "it has not been started"
        self._current_stop: StopSignal | None = None
        self._calling = threading.Lock()
        # The connections were broken during this call: the process group must be formed again.
        self._broken = False
        # Ranks still in a call that failed elsewhere, when they were interrupted.
        self._still_in_call: list[int] = []
        # What the user must know after the process group was formed again (FSDP models).
        self._regroup_note = ""
        self._generation = 0  # how many times the process group was formed again
        # The rank whose error caused the last failed call: what debug() opens by default.
        self._last_failed_rank: int | None = None
        self._call_first_line = 0  # the report's first output line of the current call

    # -- the group's life --------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the workers are up and answering calls."""
        return self._group is not None

    def start(self) -> None:
        """Start the workers and wait until each has joined the process group."""
        if self._group is not None:
            return
        self.report = self.plan.new_report(started_at=time.time())
        self._feed = RunFeed(self.report, self._observers)
        self._finished = {0: {}}
        self._opened = contextlib.ExitStack()
        try:
            with interrupts_stop(None) as stop:
                opening = open_group(self.plan, self._emit, None, 0, interrupt=stop)
                self._group = self._opened.enter_context(opening)
                self._serve_until(lambda: self._answered(0, self.ranks), START_SECONDS, stop)
        except BaseException as error:
            self._end(f"it failed to start ({type(error).__name__})")
            raise
        self.report.status = "running"

    def restart(self) -> None:
        """End the workers if they run, and start new ones (their state is gone)."""
        self.close()
        self.start()

    def close(self) -> None:
        """Let the workers finish and exit, then release everything (once; safe to repeat):
        on a Ray cluster their agents, placement group, GPUs and CPUs too, unless
        `start_workers` was given `keep_warm`."""
        group = self._group
        if group is None:
            return
        try:
            group.end_calls()
            deadline = time.monotonic() + CLOSE_SECONDS
            # Told to finish, the workers exit: only an error or a bad exit fails.
            group.serve_until(group.all_exited, deadline, None, group.failed_workers)
        except BaseException:  # noqa: BLE001 - the group ends below either way
            pass
        self._end("it was closed")

    def __enter__(self) -> LiveWorkers:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.alive else f"ended: {self._ended_because}"
        return f"<LiveWorkers {len(self.ranks)} x {self.plan.platform.name}, {state}>"

    # -- calls -------------------------------------------------------------------

    def run(
        self,
        function: Callable[..., Any],
        *args: Any,
        kwargs: dict[str, Any] | None = None,
        ranks: Sequence[int] | None = None,
        return_all: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Call `function(*args, **kwargs)` on every worker (or `ranks`) and return the
        first chosen rank's value, or with `return_all` a list of every chosen rank's.

        The function reads global names from the worker's namespace first, so
        what earlier calls and cells left there (a prepared model) is at hand.
        Raises WorkerError if it raised on a worker (the workers stay up),
        KeyboardInterrupt or TimeoutError when stopped (they stay up if they
        stopped in time), GroupEnded if the group is not running.
        """
        from notebook_accel.launch.packing import SentValues, pack

        if not callable(function):
            raise TypeError(f"run() needs a function to call, got {type(function).__name__}")
        self._sent = self._sent or SentValues()
        payload = pack(function, args, kwargs or {}, live=True, sent=self._sent)
        return self._call("function", payload, ranks, return_all, timeout, "<function>")

    def run_cell(
        self,
        source: str,
        ranks: Sequence[int] | None = None,
        return_all: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """Run a cell's code in every worker's namespace (or `ranks`'); return the value
        of its last line if that is an expression, as a notebook shows it."""
        call_id = next(self._ids)
        filename = f"<cell {call_id} on workers>"
        return self._call("cell", source.encode(), ranks, return_all, timeout, filename, call_id)

    def _call(
        self,
        kind: str,
        payload: bytes,
        ranks: Sequence[int] | None,
        return_all: bool,
        timeout: float | None,
        filename: str,
        call_id: int | None = None,
    ) -> Any:
        group = self._running_group()
        chosen = self._chosen(ranks)
        if not self._calling.acquire(blocking=False):
            raise RuntimeError(
                "another call to these workers is still running (from another thread); "
                "the workers take one call at a time"
            )
        try:
            return self._call_once(
                group, kind, payload, chosen, return_all, timeout, filename, call_id
            )
        finally:
            self._calling.release()

    def _call_once(
        self,
        group: WorkerGroupBase,
        kind: str,
        payload: bytes,
        chosen: list[int],
        return_all: bool,
        timeout: float | None,
        filename: str,
        call_id: int | None,
    ) -> Any:
        call_id = call_id if call_id is not None else next(self._ids)
        call = Call(call_id, kind, payload, tuple(chosen), return_all, filename)
        self._finished[call_id] = {}
        timeout = self.call_timeout if timeout is None else timeout
        self._drop_call_view()
        self._call_first_line = self.report.lines_received  # its view shows its own
        self._broken = False
        self._still_in_call = []
        self._regroup_note = ""
        try:
            # A stop press (or interrupt() from another thread, the panel's Stop)
            # from here on interrupts the call on the workers.
            with self._stoppable() as stop:
                self._notice_deaths(group)
                self._send(group, call)
                try:
                    self._serve_until(lambda: self._settled(call_id, chosen), timeout, stop)
                    if not self._answered(call_id, chosen):
                        self._bring_out(call_id, chosen, stop)
                except (KeyboardInterrupt, TimeoutError) as why:
                    self._interrupt(call_id, chosen, why, timeout)
        finally:
            self._finish_view()
        answers = self._finished.pop(call_id)
        not_formed = self._form_again_if_broken()
        return self._outcome(answers, chosen, return_all, not_formed)

    def _notice_deaths(self, group: WorkerGroupBase) -> None:
        """Before a call: a worker that died since the last one ends the group, named."""
        group.poll()
        if any(worker.ended or worker.error for worker in group.workers):
            with contextlib.suppress(TimeoutError):
                self._serve_until(lambda: False, EXIT_NOTICE_SECONDS, None)  # WorkerError

    def _send(self, group: WorkerGroupBase, call: Call) -> None:
        deadline = time.monotonic() + SEND_SECONDS
        data = frame(call)
        try:
            for rank in call.ranks:
                group.send(rank, data, deadline)
        except (OSError, TimeoutError) as error:
            # Most often a worker that died since the last call (its link is closed):
            # wait for its exit, to name it.
            with contextlib.suppress(TimeoutError):
                self._serve_until(lambda: False, EXIT_NOTICE_SECONDS, None)  # WorkerError
            self._end(f"a worker stopped reading calls ({error})")
            raise GroupEnded(
                f"a worker did not take the call ({error}); the group was ended. {RESTART}"
            ) from None

    def _bring_out(self, call_id: int, chosen: list[int], stop: StopSignal) -> None:
        """A rank failed while others are still in the call: the call has failed, and
        a peer waiting for the failed rank in a collective would wait for the process
        group's timeout (30 minutes). Give them a moment, then interrupt them and
        break the connections, which ends any such wait at once."""
        done = lambda: self._answered(call_id, chosen)  # noqa: E731
        if self._wait(done, FAILURE_SETTLE_SECONDS, stop):
            return
        self._still_in_call = pending = self._pending(call_id, chosen)
        self._signal(pending, signal.SIGINT)
        self._break_connections()
        if self._wait(done, STOP_GRACE_SECONDS, stop):
            return
        stuck = self._pending(call_id, chosen)
        failures = self._failures(self._finished.get(call_id, {}), chosen)
        self._end(f"{_ranks(stuck)} did not leave a call that failed")
        raise WorkerError(
            failures,
            ending=f"{_ranks(stuck)} did not leave the call within {STOP_GRACE_SECONDS:.0f} s "
            f"(it ignores interrupts), so the group was ended. {RESTART}",
        )

    def _interrupt(
        self, call_id: int, chosen: list[int], why: BaseException, timeout: float | None
    ) -> None:
        """Interrupt the call on the workers, bring any worker stuck in a collective out of
        it, and raise `why` saying so; end the group if they do not stop in time."""
        self._signal(self._pending(call_id, chosen), signal.SIGINT)
        reason = "timeout" if isinstance(why, TimeoutError) else "stop"
        done = lambda: self._answered(call_id, chosen)  # noqa: E731
        stuck: list[int] = []
        try:
            with self._stoppable() as second_press:
                if not self._wait(done, BREAK_AFTER_SECONDS, second_press):
                    # Still in the call after the forced interrupt: most likely in a
                    # collective whose peers have left it.
                    stuck = self._pending(call_id, chosen)
                    if not self._broken:
                        self._break_connections()
                    grace = STOP_GRACE_SECONDS - BREAK_AFTER_SECONDS
                    if not self._wait(done, grace, second_press):
                        raise TimeoutError
        except WorkerError:
            raise  # a worker died meanwhile: the group was ended, and the error names it
        except (KeyboardInterrupt, TimeoutError) as failed:
            what = "a second stop" if isinstance(failed, KeyboardInterrupt) else "no answer"
            self._end(f"the workers did not stop in time after a {reason} ({what})")
            message = (
                f"the call was {'stopped' if reason == 'stop' else 'timed out'} and the workers "
                f"did not stop within {STOP_GRACE_SECONDS:.0f} s ({what}; code that ignores "
                f"interrupts, or stuck in C code, cannot be stopped), so the group was ended. "
                f"{RESTART}"
            )
            raise type(why)(message) from None
        not_formed = self._form_again_if_broken()
        if not_formed:
            raise type(why)(
                f"the call was {'stopped' if reason == 'stop' else 'timed out'}; "
                f"{_ranks(stuck)} had to be taken out of a collective, and {not_formed}"
            ) from None
        brought_out = ""
        if stuck:
            brought_out = (
                f"; {_ranks(stuck)} {'was' if len(stuck) == 1 else 'were'} waiting in a "
                "collective that its peers had left, so the workers' connections were broken "
                "and the process group was formed again"
            )
        note = self._regroup_note
        if isinstance(why, TimeoutError):
            raise TimeoutError(
                f"the call did not finish within timeout={timeout} s; it was interrupted on "
                f"every worker{brought_out}; the workers are still running with their state."
                f"{note}"
            ) from None
        raise KeyboardInterrupt(
            f"the call was stopped on every worker{brought_out}; they are still running.{note}"
        )

    def _break_connections(self) -> None:
        """Have every worker shut down its connections to the others: any collective
        they wait in (or start) fails at once (live/regroup.py)."""
        group = self._running_group()
        addresses = pickle.dumps(group.connection_addresses())
        self._send(group, Call(next(self._ids), "break", addresses, tuple(self.ranks)))
        self._broken = True

    def _form_again_if_broken(self) -> str | None:
        """After the connections were broken: every worker forms the process group again.
        If they cannot, the group is ended: returns what to tell the user, else None."""
        if not self._broken:
            return None
        self._broken = False
        group = self._running_group()
        self._generation += 1
        call_id = next(self._ids)
        self._finished[call_id] = {}
        call = Call(call_id, "regroup", str(self._generation).encode(), tuple(self.ranks))
        done = lambda: self._answered(call_id, self.ranks)  # noqa: E731
        why = ""
        try:
            with interrupts_stop(None) as stop:
                self._send(group, call)
                if not self._wait(done, REGROUP_SECONDS, stop):
                    why = f"no answer within {REGROUP_SECONDS:.0f} s"
        except KeyboardInterrupt:
            why = "it was stopped"
        formed = self._finished.pop(call_id, {})
        why = why or "; ".join(f"rank {a.rank}: {a.error}" for a in formed.values() if a.error)
        if not why:
            sharded = sorted({name for a in formed.values() for name in a.value["fsdp_models"]})
            if sharded:
                self._regroup_note = (
                    f" FSDP models keep the old process group and fail at their next "
                    f"collective: prepare them again ({', '.join(sharded)})."
                )
            return None
        self._end(f"its process group could not be formed again ({why})")
        return (
            f"the process group could not be formed again ({why}), so the group was ended. "
            f"{RESTART}"
        )

    def _outcome(
        self,
        answers: dict[int, CallFinished],
        chosen: list[int],
        return_all: bool,
        not_formed: str | None = None,
    ) -> Any:
        failures = self._failures(answers, chosen)
        if not_formed and not failures:
            raise GroupEnded(not_formed)
        if failures:
            self._last_failed_rank = failures[0].rank
            ending = "the workers are still running, with their state."
            still_in_call = self._still_in_call
            if still_in_call:
                was = "was" if len(still_in_call) == 1 else "were"
                ending = (
                    f"{_ranks(still_in_call)}, still in the call, {was} interrupted and taken "
                    "out of any collective (the workers' connections were broken and the "
                    f"process group was formed again); {ending}{self._regroup_note}"
                )
            if not_formed:
                ending = (
                    f"{_ranks(still_in_call)}, still in the call, had to be taken out of any "
                    f"collective, and {not_formed}"
                )
            raise WorkerError(failures, ending=ending)
        values = [unpack(answers[rank].value, rank) for rank in chosen]
        return values if return_all else values[0]

    @staticmethod
    def _failures(answers: dict[int, CallFinished], chosen: list[int]) -> list[WorkerFailure]:
        """The chosen ranks' errors, the cause first: in the order they came (a rank
        that failed first is the cause; one that lost its connection after it is a
        consequence), and interrupts last."""
        failed = [answer for answer in answers.values() if answer.error and answer.rank in chosen]
        failed.sort(key=lambda answer: "KeyboardInterrupt" in answer.error)
        return [
            WorkerFailure(a.rank, None, traceback=a.traceback, exception=a.error) for a in failed
        ]

    def debug(self, rank: int | None = None, timeout: float | None = None) -> None:
        """Open pdb on the frames of the last call that failed on `rank` (by default the
        rank whose error failed the last failed call), as `%debug` does for the
        kernel's own errors: its prompts come to this cell, prefixed with the rank.
        Move up and down, print locals, evaluate expressions; `c` or `q` ends the
        debugger, and the worker stays up with its state. The worker keeps that
        error (and what its frames hold) until a later call fails there."""
        from notebook_accel.live.serve import debug_last_error

        if rank is None:
            if self._last_failed_rank is None:
                raise RuntimeError(
                    "no call has failed on these workers: there is nothing to debug. "
                    "debug(rank) opens a rank's last error."
                )
            rank = self._last_failed_rank
        self.run(debug_last_error, ranks=[rank], timeout=timeout)

    def interrupt(self) -> None:
        """Interrupt the running call, as the notebook's stop button does (from any
        thread: the panel's Stop calls it); a second call ends the group. Nothing
        happens when no call runs."""
        stop = self._current_stop
        if stop is not None:
            stop.set()

    def add_observer(self, observer: RunObserver) -> None:
        """Have `observer` receive the group's events from now on (the panel's views)."""
        self._observers.append(observer)

    # -- plumbing ----------------------------------------------------------------

    @contextlib.contextmanager
    def _stoppable(self) -> Iterator[StopSignal]:
        """A stop signal for the running call: set by a stop press in the main thread
        (SIGINT) or by `interrupt()` from any thread."""
        stop = StopSignal()
        self._current_stop = stop
        try:
            with interrupts_stop(stop):
                yield stop
        finally:
            self._current_stop = None
            stop.close()

    def _running_group(self) -> WorkerGroupBase:
        if self._group is None:
            raise GroupEnded(
                f"the live workers are not running: {self._ended_because}. "
                "workers.restart() starts them again."
            )
        return self._group

    def _chosen(self, ranks: Sequence[int] | None) -> list[int]:
        if ranks is None:
            return list(self.ranks)
        chosen = sorted({int(rank) for rank in ranks})
        unknown = [rank for rank in chosen if rank not in self.ranks]
        if not chosen or unknown:
            raise ValueError(
                f"ranks={list(ranks)} must name some of this group's ranks, {self.ranks}."
            )
        return chosen

    def _answered(self, call_id: int, ranks: list[int]) -> bool:
        answers = self._finished.get(call_id, {})
        return all(rank in answers for rank in ranks)

    def _settled(self, call_id: int, ranks: list[int]) -> bool:
        """Every rank answered, or one of them failed (the call has failed)."""
        answers = self._finished.get(call_id, {})
        return all(rank in answers for rank in ranks) or any(a.error for a in answers.values())

    def _pending(self, call_id: int, ranks: list[int]) -> list[int]:
        answers = self._finished.get(call_id, {})
        return [rank for rank in ranks if rank not in answers]

    def _signal(self, ranks: list[int], signum: int) -> None:
        group = self._running_group()
        for rank in ranks:
            group.signal(rank, signum)

    def _wait(self, done: Callable[[], bool], seconds: float, stop: StopSignal | None) -> bool:
        """Serve the workers until `done()` (True) or for `seconds` (False)."""
        try:
            self._serve_until(done, seconds, stop)
        except TimeoutError:
            return False
        return True

    def _serve_until(
        self, done: Callable[[], bool], seconds: float | None, stop: StopSignal | None
    ) -> None:
        group = self._running_group()
        deadline = None if seconds is None else time.monotonic() + seconds
        try:
            group.serve_until(done, deadline, stop)
        except WorkerError as failure:
            self._end(f"{failure.failures[0].describe()}")
            raise WorkerError(failure.failures, ending=f"the group was ended. {RESTART}") from None

    def _emit(self, event: RunEvent) -> None:
        if isinstance(event, CallFinished):
            self._finished.setdefault(event.call_id, {})[event.rank] = event
            return
        if isinstance(event, (MetricRecord, Progress)) and self._call_view is None:
            self._call_view = self._new_view()
            if self._call_view is not None:
                self._observers.append(self._call_view)
        self._feed(event)

    def _new_view(self) -> RunObserver | None:
        if self._live is False:
            return None
        from notebook_accel.views.live import in_notebook, live_view

        if self._live is None and not in_notebook():
            return None
        return live_view(self.plan, since=self._call_first_line)

    def _finish_view(self) -> None:
        """Every view draws the call's last figures (views redraw at a bounded rate,
        and the group goes on, so no final redraw comes otherwise)."""
        views = [*self._observers]
        self._drop_call_view()
        for view in views:
            if getattr(view, "report", None) is not None and hasattr(view, "changed"):
                view.changed(final=False)

    def _drop_call_view(self) -> None:
        view, self._call_view = self._call_view, None
        if view is not None:
            self._observers.remove(view)

    def _end(self, because: str) -> None:
        self._group = None
        opened, self._opened = self._opened, None
        self._ended_because = because
        if opened is not None:  # stops the workers, and releases what they held
            opened.close()
        self.report.status = "stopped"


def _ranks(ranks: list[int]) -> str:
    """ "worker rank 0", "worker ranks 0, 2" """
    if len(ranks) == 1:
        return f"worker rank {ranks[0]}"
    return f"worker ranks {', '.join(map(str, ranks))}"
