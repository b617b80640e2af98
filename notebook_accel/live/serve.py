"""The live worker's loop: join the group once, then run call after call.

Each worker keeps one namespace for the life of the group: its `__main__`,
which a forked worker inherits from the kernel as it was at the start. A
cell's code runs in it, and a function sent from the kernel reads its global
names from it first, so a model and optimizer prepared in one cell are still
there, on the device, in the next.

Between calls the worker ignores the stop button (the kernel decides). During
a call a SIGINT from the kernel first asks the code to stop: a training loop
that calls `accelerator.check_trigger()` each step stops at the same step on
every worker and returns. Code that does not check gets KeyboardInterrupt
where it runs; the call ends with that error and the worker waits for the
next one, its state intact. Code stuck in C++ (a collective a peer left)
cannot be interrupted: the kernel then has every worker break its
connections to the others, which fails the collective at once, and form the
process group again (live/regroup.py).

Calls come down the worker's link (launch/channel.py) as `Call` frames, the
function, its arguments or a cell's source inside by value (cloudpickle, as
for workers in fresh interpreters: a function defined after the workers
started exists only in the kernel); what comes back goes up as a
`CallFinished` (reporting/events.py), its value packed by live/values.py.
Besides the user's calls, the kernel sends two of its own (live/regroup.py):
"break" (every worker shuts down its connections to the others, at once, even
in the middle of a call) and "regroup" (every worker forms the process group
again, then answers).

One thread reads all that comes down the link: calls are handed to the main
thread, which runs them, and answers to the main thread's prompt (a debugger
in a call, launch/debugging.py) to that prompt; only the order to break the
connections is carried out on the reading thread itself, since the main
thread may be the one stuck.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from notebook_accel.launch import debugging
from notebook_accel.launch.channel import ChannelWriter
from notebook_accel.live import regroup
from notebook_accel.live.values import pack
from notebook_accel.reporting.events import CallFinished
from notebook_accel.training import interrupts
from notebook_accel.training.nested import to_cpu

# A stop press asks the code to stop at its next check_trigger(); code that has
# not stopped this much later is interrupted where it runs (the launcher waits
# STOP_GRACE_SECONDS in all, live/group.py).
FORCE_AFTER_SECONDS = 2.0

# The last error a call raised in this worker, for LiveWorkers.debug(): kept until the
# next one, as IPython keeps the kernel's last error for %debug.
_last_error: BaseException | None = None


@dataclass(frozen=True)
class Call:
    """One request to every chosen rank: run a function, or a cell's source."""

    call_id: int
    # "function": `payload` is (function, args, kwargs) pickled by value;
    # "cell": `payload` is the cell's source, utf-8;
    # "break": `payload` is the local addresses of the workers' TCP connections,
    # pickled (no answer);
    # "regroup": `payload` is the new group's generation number, as text.
    kind: str
    payload: bytes
    ranks: tuple[int, ...]
    # Every chosen rank sends its value back, not only the first chosen one.
    return_all: bool = False
    # The name tracebacks give a cell's code ("<cell 3 on workers>").
    filename: str = "<cell on workers>"


def serve() -> None:
    """Run as each live worker's function: join the process group, then serve calls
    until the kernel ends its side of the link."""
    from notebook_accel.launch import worker
    from notebook_accel.training.state import PartialState

    state = PartialState()  # joins the process group, as Accelerator() would
    channel = worker.current_channel()
    namespace = sys.modules["__main__"].__dict__
    calls = _Downlink(channel)
    debugging.install(channel, state.process_index, calls.next_answer)
    signal.signal(signal.SIGALRM, _force_stop)  # armed by a stop press in a call
    channel.send(CallFinished(state.process_index, 0))  # ready
    while (call := calls.next_call()) is not None:
        if call.kind == "regroup":
            channel.send(_formed_again(call, state.process_index))
        elif state.process_index in call.ranks:
            channel.send(_answer(call, namespace, state.process_index))


class _Downlink:
    """The one reader of what comes down the link, on a thread of its own: calls for
    `next_call()`, answers for `next_answer()`, in order. An order to break the
    connections ("break") is carried out at once, on the reading thread, wherever the
    main thread is."""

    def __init__(self, channel: ChannelWriter) -> None:
        self._channel = channel
        self._calls: queue.SimpleQueue[Call | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[debugging.Answer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._read, name="notebook_accel-live-calls", daemon=True
        )
        self._thread.start()

    def next_call(self) -> Call | None:
        """The next call, or None once the kernel ended its side (waits for it)."""
        while True:
            with contextlib.suppress(queue.Empty):
                return self._calls.get(timeout=1.0)

    def next_answer(self) -> debugging.Answer | None:
        """The answer to this worker's prompt, or None once the kernel ended its side."""
        return self._answers.get()

    def _read(self) -> None:
        # Stop presses and the forced interrupt's alarm are for the main thread: a
        # signal this thread took would not wake the main thread's sleep.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGALRM})
        try:
            while (item := self._channel.receive()) is not None:
                if isinstance(item, debugging.Answer):
                    self._answers.put(item)
                elif item.kind == "break":
                    with contextlib.suppress(Exception):  # then the kernel ends the group
                        regroup.break_connections(pickle.loads(item.payload))
                else:
                    self._calls.put(item)
        finally:
            self._calls.put(None)
            self._answers.put(None)


def _answer(call: Call, namespace: dict[str, Any], rank: int) -> CallFinished:
    started = time.perf_counter()
    try:
        with _interruptible():
            value = _execute(call, namespace)
        wanted = call.return_all or rank == call.ranks[0]
        finished = CallFinished(rank, call.call_id, value=pack(to_cpu(value)) if wanted else None)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the kernel
        return _failed(rank, call, error, started)
    finished.seconds = time.perf_counter() - started
    return finished


def _formed_again(call: Call, rank: int) -> CallFinished:
    """Form the process group again (after its connections were broken)."""
    started = time.perf_counter()
    try:
        summary = regroup.form_again(int(call.payload))
    except BaseException as error:  # noqa: BLE001 - the kernel ends the group on failure
        return _failed(rank, call, error, started)
    return CallFinished(rank, call.call_id, value=summary, seconds=time.perf_counter() - started)


def _failed(rank: int, call: Call, error: BaseException, started: float) -> CallFinished:
    global _last_error
    _last_error = error
    return CallFinished(
        rank,
        call.call_id,
        error=f"{type(error).__name__}: {error}" if str(error) else type(error).__name__,
        traceback=_user_traceback(error),
        seconds=time.perf_counter() - started,
    )


def _execute(call: Call, namespace: dict[str, Any]) -> Any:
    if call.kind == "cell":
        return run_cell(call.payload.decode(), namespace, call.filename)
    from notebook_accel.launch.packing import unpack_in_namespace

    function, args, kwargs = unpack_in_namespace(call.payload, namespace)
    return function(*args, **kwargs)


def run_cell(source: str, namespace: dict[str, Any], filename: str) -> Any:
    """Run a cell's code in `namespace`; return the value of its last line if that is an
    expression (as a notebook shows it), else None."""
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)  # for tracebacks
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the user's own cell
    if last is None:
        return None
    return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)  # noqa: S307


# Whether a call's code runs: outside a call the stop handlers below do nothing.
_in_call = False


def _ask_to_stop(signum: int, frame: Any) -> None:
    if _in_call:
        interrupts.request()
        signal.setitimer(signal.ITIMER_REAL, FORCE_AFTER_SECONDS)


def _force_stop(signum: int, frame: Any) -> None:
    if _in_call:
        raise KeyboardInterrupt("interrupted from the notebook")


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """While the user's code runs, SIGINT asks it to stop: at once through
    `Accelerator.check_trigger()` (training/interrupts.py), and with
    KeyboardInterrupt where it runs if it has not stopped FORCE_AFTER_SECONDS
    later. Outside a call both signals change nothing."""
    global _in_call
    interrupts.clear()
    # Each call, not once: the last call's code may have put in a handler of its own.
    signal.signal(signal.SIGINT, _ask_to_stop)
    _in_call = True
    try:
        yield
    finally:
        _in_call = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        interrupts.clear()


def debug_last_error() -> None:
    """In a live worker: pdb on the frames of the last call that failed here, prompting
    in the cell (LiveWorkers.debug)."""
    error = _last_error
    if error is None:
        raise RuntimeError("no call has failed on this worker: there is nothing to debug")
    debugging.post_mortem(error, _user_frames(error), int(os.environ.get("RANK", "0")))


def _user_traceback(error: BaseException) -> str:
    """The traceback from the user's code down, without this loop's frames."""
    return "".join(traceback.format_exception(type(error), error, _user_frames(error)))


def _user_frames(error: BaseException) -> TracebackType | None:
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb
