"""Where each worker is, when a run makes no progress: their Python stacks, read and told.

Every worker registers faulthandler on `STACK_SIGNAL`: on that signal the
interpreter writes every thread's Python stack to the worker's stderr from C,
so it answers even while the worker waits inside a collective that never
returns (a Python signal handler would wait for it). The launcher sends the
signal when the workers have made no progress for a while, or when Stop is
pressed on a run that is stuck, reads the stacks out of their stderr
(`StackCapture`), and shows for each rank where it is (`explain`): the
collective it waits in, if any, and the line of the notebook that called it.

One collective has no Python frame: the gradient all-reduce that
DistributedDataParallel's reducer starts from C++ hooks inside autograd, and
waits for in C++ at the end of the backward. Its stack ends in autograd's
engine, which alone would also be a backward that is merely slow (and DDP
exposes no state that says it waits); so the same signal also wakes a thread of
the worker that says whether it is that all-reduce (`StackRequests`). It can while
the main thread waits in C++ with the GIL released, as autograd and the
collectives do; a worker that holds the GIL is shown from its stack alone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TextIO

# The signal a worker answers with its stacks (SIGUSR1 is often taken by tools).
STACK_SIGNAL = signal.SIGUSR2

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
# What else faulthandler writes inside a dump.
_OTHER_DUMP_LINES = ("  <no Python frame>", "  ...", "")

# torch.distributed's collectives, as they appear as functions in a stack.
_COLLECTIVES_FILE = "torch/distributed/distributed_c10d.py"
# The file of the innermost Python frame of a thread in which autograd's engine runs a
# backward in C++: torch.autograd.backward and grad hand it over in this file's
# _engine_run_backward on every torch of the tested range (a stack is matched by file, as
# with the collectives; a hook or Function written in Python is a frame above it).
_AUTOGRAD_ENGINE_FILE = "torch/autograd/graph.py"
DDP_ALL_REDUCE = "DistributedDataParallel's gradient all-reduce"
# Python's own frozen modules (the import machinery): "<frozen importlib._bootstrap>".
_FROZEN = "<frozen "
# The worker's own entry: in the stack of the thread that runs the user's function.
_WORKER_FILE = "notebook_accel/launch/worker.py"
# The frames that call the user's function in a worker (a launch's, a live worker's)
_SCAFFOLDING = re.compile(r"/notebook_accel/(launch|live)/")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def in_libraries(self) -> bool:
        """Whether this is a frame of an installed package, of Python itself or of this
        package (not of the user's code: a notebook cell, a file of theirs)."""
        return self.file.startswith(_FROZEN) or any(
            part in self.file for part in ("site-packages/", "/lib/python3", "/notebook_accel/")
        )

    @property
    def place(self) -> str:
        return f"{self.function} ({self.file}, line {self.line})"

    def show(self) -> str:
        marker = "->" if not self.in_libraries else "  "
        return f"{marker} {self.file}, line {self.line}, in {self.function}"


@dataclass(frozen=True)
class StacksNote:
    """What a worker adds to its stacks when the launcher asks (an event down its
    channel; no progress of the run's): `gradient_all_reduce_pending()`."""

    rank: int
    gradient_all_reduce: bool


def gradient_all_reduce_pending() -> bool:
    """In a worker: whether its main thread is inside autograd's engine (a backward run
    in C++) while a DistributedDataParallel model of this process syncs gradients in its
    backward (DDP's own `require_backward_grad_sync`, which `no_sync()` turns off)."""
    ddp = sys.modules.get("torch.nn.parallel.distributed")
    frame = sys._current_frames().get(threading.main_thread().ident)
    if ddp is None or frame is None or not frame.f_code.co_filename.endswith(_AUTOGRAD_ENGINE_FILE):
        return False
    # Looked for only here (a hang report), not tracked: no hook on the user's models.
    return any(
        isinstance(model, ddp.DistributedDataParallel) and model.require_backward_grad_sync
        for model in gc.get_objects()
    )


class StackRequests:
    """A worker's side of `STACK_SIGNAL`, set up once at its start (in its main thread).

    faulthandler writes every thread's stack to `file` from C, then (chain=True) calls
    Python's own handler of the signal, which writes the signal's number to the wakeup
    descriptor (`signal.set_wakeup_fd`); `answer_with(send)` starts the thread that reads
    it and sends this worker's StacksNote. Code that sets its own wakeup descriptor
    later (an asyncio loop's signal handlers) ends the notes, not the stacks.
    """

    def __init__(self, file: TextIO) -> None:
        self._wakeups: int | None = None
        # A registration inherited from the forking process goes (chain=True needs ours
        # installed afresh, after Python's handler).
        faulthandler.unregister(STACK_SIGNAL)
        wakeups, wakeup = os.pipe()
        os.set_blocking(wakeup, False)
        try:
            # Python's half of the handler: its C half writes the wakeup byte; nothing else.
            signal.signal(STACK_SIGNAL, lambda signum, frame: None)
            signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
            self._wakeups = wakeups
        except ValueError:  # not this interpreter's main thread: stacks without notes
            os.close(wakeups)
            os.close(wakeup)
        faulthandler.register(STACK_SIGNAL, file=file, all_threads=True, chain=True)

    def answer_with(self, send: Callable[[StacksNote], None], rank: int) -> None:
        """Send a StacksNote with `send` each time the signal comes (on a thread)."""
        if self._wakeups is None:
            return

        def answer() -> None:
            with contextlib.suppress(OSError):
                while signals := os.read(self._wakeups, 64):
                    if int(STACK_SIGNAL) in signals:
                        # A note not made or not sent (the launcher is gone): the stack alone tells.
                        with contextlib.suppress(Exception):
                            send(StacksNote(rank, gradient_all_reduce_pending()))

        threading.Thread(target=answer, name="notebook_accel-stacks", daemon=True).start()


@dataclass
class StackCapture:
    """One worker's stderr lines that belong to a stack dump, taken out of its output
    while a dump is awaited. `threads`: each thread's frames, innermost first; `note`:
    the worker's StacksNote, once it came."""

    awaited: bool = False
    threads: list[list[Frame]] = field(default_factory=list)
    note: StacksNote | None = None
    _filling: list[Frame] | None = None

    def expect(self) -> None:
        """A dump was asked for: its lines are taken from now on."""
        self.awaited, self._filling, self.threads, self.note = True, None, [], None

    def take(self, line: str) -> bool:
        """Whether `line` (one line of stderr, newline included) belonged to the dump."""
        if not self.awaited:
            return False
        text = line.rstrip("\n")
        if _THREAD.match(text):
            self._filling = []
            self.threads.append(self._filling)
            return True
        frame = _FRAME.match(text)
        if frame and self._filling is not None:
            self._filling.append(Frame(frame["file"], int(frame["line"]), frame["function"]))
            return True
        if self._filling is not None and text in _OTHER_DUMP_LINES:
            return True
        self._filling = None
        return False

    def finish(self) -> list[Frame]:
        """The stack of the thread that runs the user's function, innermost first, down to
        the worker's own frames (those below are the launcher's, inherited by the fork);
        no longer awaiting a dump."""
        self.awaited, self._filling = False, None
        running = [t for t in self.threads if any(f.file.endswith(_WORKER_FILE) for f in t)]
        frames = (running or self.threads or [[]])[0]
        end = next((i for i, f in enumerate(frames) if _SCAFFOLDING.search(f.file)), None)
        return frames[:end]


def collective_of(frames: list[Frame], gradient_all_reduce: bool = False) -> str | None:
    """The collective the stack waits in (innermost first), if any: a torch.distributed
    function's name, or DDP_ALL_REDUCE where the stack is in autograd's engine and the
    worker said its DDP model all-reduces gradients there (`gradient_all_reduce`)."""
    waiting = [f.function for f in frames if f.file.endswith(_COLLECTIVES_FILE)]
    if waiting:
        return waiting[-1]  # the outermost: the one the user called
    if gradient_all_reduce and frames and frames[0].file.endswith(_AUTOGRAD_ENGINE_FILE):
        return DDP_ALL_REDUCE
    return None


def explain(
    reason: str,
    stacks: dict[int, list[Frame]],
    ended: dict[int, str],
    all_reducing: Collection[int] = (),
) -> str:
    """What the cell shows: for each rank where it is, then who waits for whom, then each
    rank's stack (innermost first; the notebook's own lines marked with ->).

    `all_reducing`: the ranks whose note said a DDP model of theirs all-reduces gradients
    in the backward they are in (`StacksNote`)."""
    lines = [f"notebook_accel: {reason}. Where each rank is:"]
    waiting: dict[str, list[int]] = {}
    elsewhere: list[int] = []
    for rank in sorted({*stacks, *ended}):
        frames = stacks.get(rank, [])
        collective = collective_of(frames, gradient_all_reduce=rank in all_reducing)
        if collective:
            waiting.setdefault(collective, []).append(rank)
        else:
            elsewhere.append(rank)
        where = ended[rank] if rank in ended else _where(frames, collective)
        lines.append(f"  rank {rank}: {where}")
    ranks = lambda numbers: ", ".join(map(str, numbers))  # noqa: E731
    if len(waiting) > 1:
        each = "; ".join(f"rank {ranks(r)} in {name}" for name, r in waiting.items())
        lines.append(
            f"  The ranks wait in different collectives ({each}): they call collectives in "
            "a different order, or one calls one more (a longer loop, an extra batch)."
        )
    elif waiting and elsewhere:
        ((name, waiters),) = waiting.items()
        lines.append(f"  Rank {ranks(waiters)} wait(s) in {name} for rank {ranks(elsewhere)}.")
    for rank in sorted(stacks):
        if stacks[rank]:
            lines.append(f"rank {rank}'s stack, innermost first:")
            lines += ["  " + frame.show() for frame in stacks[rank]]
    # torch's check helps only where the collectives the ranks wait in may not match: they
    # differ, or all ranks wait in one (its sizes may differ). A rank elsewhere is named above.
    if waiting and (len(waiting) > 1 or not elsewhere):
        lines.append(
            "A collective waits until every rank of the group calls the same one; to have "
            "torch check that they match (and name the mismatch), run with "
            "TORCH_DISTRIBUTED_DEBUG=DETAIL in the workers' environment."
        )
    return "\n".join(lines) + "\n"


def _where(frames: list[Frame], collective: str | None) -> str:
    """Where a rank that answered is, from its stack and the collective it waits in."""
    if not frames:
        return "did not answer (busy in native code without Python)"
    # The innermost frame of the user's own code (a notebook cell or a local file).
    mine = next((f for f in frames if not f.in_libraries), None)
    at = mine.place if mine else "no frame of yours"
    if collective == DDP_ALL_REDUCE:
        return f"waits in {collective} (inside backward), called from {at}"
    if collective:
        return f"waits in torch.distributed.{collective}, called from {at}"
    if frames[0] is mine:
        return f"not in a collective, at {at}"
    # In an import: the module the user's line imports is the outermost module body that
    # Python's import machinery runs inside the user's frame.
    inner = frames[: frames.index(mine)] if mine is not None else frames
    bodies = [frame.file for frame in inner if frame.function == "<module>"]
    if bodies and any(frame.file.startswith(_FROZEN + "importlib") for frame in inner):
        return f"not in a collective: importing {bodies[-1]}, called from {at}"
    return f"not in a collective: in {frames[0].place}, called from {at}"
