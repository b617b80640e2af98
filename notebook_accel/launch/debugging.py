"""A worker's stdin, `breakpoint()` and post-mortem debugger, answered in the cell.

A worker's `sys.stdin` reads from the notebook: `input()`, `breakpoint()` and
`pdb.set_trace()` in the training function write their prompt to stdout, send
`InputRequested` up the channel and wait for the `Answer`, which comes down
the same link (launch/channel.py). The launching process (launch/supervisor.py)
takes the unfinished last line of that worker's stdout as the prompt, asks for
a line where the user runs the launch (`input()`: Jupyter's stdin request in a
kernel, the terminal in a script), prefixed with the rank, and sends it back.
On a Ray cluster the node's agent relays both ways. Where nobody can answer
the answer says why: `input()` then raises EOFError and a debugger continues,
so a forgotten `breakpoint()` never hangs a run. What the user sees, time at
prompts, unattended stdin and post-mortems included: docs/guides/debugging.md.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import re
import select
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

from notebook_accel.reporting.events import InputRequested

if TYPE_CHECKING:
    from notebook_accel.launch.channel import ChannelWriter

# The frames that call the user's function in a worker (a launch's, a live one's), and
# above them the launching process's own, which a forked worker's stack still holds.
_SCAFFOLDING = re.compile(r"/notebook_accel/(launch|live|platforms)/")

POST_MORTEM_HELP = (
    "up/down move through its frames, p/pp print, any expression is evaluated; c or q leaves it"
)


class InputUnavailable(Exception):
    """Nobody can answer a worker's prompt here; the message says why. `shown`: the
    prompt was already written where the launch runs (it is not to be shown again)."""

    def __init__(self, why: str, shown: bool = False) -> None:
        super().__init__(why)
        self.shown = shown


# -- the launching process's side --------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What the launching process sends down to a worker's prompt: the line, or None and
    why there is none."""

    line: str | None
    reason: str = ""


def person_answers() -> bool:
    """Whether a person answers `ask_in_cell` here (a frontend's input(), which a kernel puts
    in place of Python's own, or a terminal), not Python's input() reading a stdin that is no
    terminal (a pipe, a file): time at a prompt then does not count towards the launch's
    timeout."""
    asks = globals().get("input", builtins.input)  # what ask_in_cell calls as input()
    if not (isinstance(asks, types.BuiltinFunctionType) and asks.__module__ == "builtins"):
        return True
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):  # no stdin, or a closed one
        return False


def ask_in_cell(rank: int, prompt: str, deadline: float | None = None) -> str:
    """The line for worker `rank`'s `prompt`, asked where this launch runs (the frontend's
    input() in a notebook, stdin in a script) with the rank before the prompt. Raises
    InputUnavailable when nobody can answer here (or, unattended, nobody did before
    `deadline`, the launch's timeout), KeyboardInterrupt when Stop is pressed at the prompt."""
    if threading.current_thread() is not threading.main_thread():
        raise InputUnavailable(
            "the launch runs on a thread other than the notebook's main one, where "
            "nobody can answer"
        )
    # The launch turns a stop press into a flag; at a prompt it must end the wait.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if not person_answers():
            return _line_from_stdin(rank, prompt, deadline)
        return input(f"[rank {rank}] {prompt}")
    except EOFError:  # input() wrote the prompt: end its line
        print(flush=True)
        raise InputUnavailable("this process's stdin is closed", shown=True) from None
    except InputUnavailable:  # KeyboardInterrupt is no Exception: it passes too
        raise
    except Exception as error:  # noqa: BLE001 - e.g. IPython's StdinNotImplementedError
        raise InputUnavailable(
            f"this frontend cannot answer input ({type(error).__name__}: {error})"
        ) from None
    finally:
        signal.signal(signal.SIGINT, previous)


def _line_from_stdin(rank: int, prompt: str, deadline: float | None) -> str:
    """The next line of this process's stdin, where no person watches: the prompt shown
    as input() would, and at once, if no line is there yet, that the run waits for one;
    the wait ends at `deadline` (InputUnavailable).

    Read a byte at a time from the descriptor, so that no later line is taken from
    whoever reads stdin next, and `select` sees all there is."""
    try:
        fd = sys.stdin.fileno()
    except (AttributeError, ValueError, OSError):
        raise InputUnavailable("this process has no stdin") from None
    if deadline is not None and time.monotonic() >= deadline:
        raise InputUnavailable("the launch's timeout has passed")
    shown = False
    if not select.select([fd], [], [], 0)[0]:  # no line there yet: say so, show the prompt, wait
        limit = (
            "it waits until one comes" if deadline is None else "the launch's timeout keeps running"
        )
        print(
            f"notebook_accel: rank {rank} waits for a line on this process's stdin, which is "
            f"not a terminal (input() or a debugger in the worker); {limit}",
            file=sys.stderr,
            flush=True,
        )
        print(f"[rank {rank}] {prompt}", end="", flush=True)
        shown = True
    line = bytearray()
    while not line.endswith(b"\n"):
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], remaining)[0]:
            print(flush=True)  # ends the prompt's line
            raise InputUnavailable(
                "nobody answered on this process's stdin before the launch's timeout", shown
            )
        byte = os.read(fd, 1)
        if not byte:  # the end of stdin
            if line:
                break
            if shown:
                print(flush=True)
            raise InputUnavailable("this process's stdin is closed", shown)
        if not shown:  # as input() does, though the answer is already there
            print(f"[rank {rank}] {prompt}", end="", flush=True)
            shown = True
        line += byte
    print(flush=True)  # nothing echoed the answer: the prompt's line ends here
    return line.decode(errors="replace").removesuffix("\n")


# -- the worker's side -------------------------------------------------------------------


class CellInput(io.TextIOBase):
    """A worker's `sys.stdin`: each line read is asked of the notebook."""

    def __init__(
        self, channel: ChannelWriter, rank: int, answers: Callable[[], Answer | None]
    ) -> None:
        super().__init__()
        self._channel, self._rank, self._answers = channel, rank, answers
        self._lock = threading.Lock()

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        return self.readline()

    def readline(self, size: int | None = -1) -> str:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # the prompt is in the pipe before the request
        with self._lock:
            try:
                self._channel.send(InputRequested(self._rank))
                answer = self._answers()
            except OSError as error:
                answer = Answer(None, f"the launching process is gone ({error})")
        if answer is None:
            answer = Answer(None, "the launching process is gone (the channel closed)")
        line, reason = answer.line, answer.reason
        if line is not None:
            return line if line.endswith("\n") else line + "\n"
        if _in_debugger(sys._getframe(1)):
            print(f"[debugger not opened: {reason}; continuing]", file=sys.stderr, flush=True)
            return "continue\n"
        print(f"[input() got no answer: {reason}]", file=sys.stderr, flush=True)
        return ""


def install(
    channel: ChannelWriter, rank: int, answers: Callable[[], Answer | None] | None = None
) -> None:
    """In a worker: stdin and `breakpoint()` answered in the notebook. `answers` waits
    for the next Answer (by default read from the channel: a live worker's one reader
    of its link hands them over instead, live/serve.py)."""
    sys.stdin = CellInput(channel, rank, answers or channel.receive)
    sys.breakpointhook = breakpoint_hook
    # A kernel replaces input() with its own, which talks to the frontend over the
    # kernel's sockets (a forked worker must not), and IPython replaces pdb.Pdb with
    # a debugger that reads through it: back to Python's, which read sys.stdin.
    builtins.input = _input
    if pdb := sys.modules.get("pdb"):
        pdb.Pdb = _python_pdb_class()


def _input(prompt: object = "") -> str:
    """input() where stdin is not a terminal, as Python does it."""
    sys.stdout.write(str(prompt))
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        raise EOFError("EOF when reading a line")
    return line[:-1] if line.endswith("\n") else line


def _python_pdb_class() -> type:
    import pdb

    return next(cls for cls in pdb.Pdb.__mro__ if cls.__module__ == "pdb")


def breakpoint_hook(*args: object, **kwargs: object) -> None:
    """`breakpoint()` in a worker: pdb on the caller's frame, its prompts in the cell.

    PYTHONBREAKPOINT keeps its meaning: "0" turns breakpoints off, another
    value names the debugger to call instead.
    """
    chosen = os.environ.get("PYTHONBREAKPOINT")
    if chosen == "0":
        return
    # ray.util.rpdb.* is set by Ray in every process of its own (a cluster node's agent),
    # for its debugger of Ray tasks; a worker forked from the agent is not one.
    if chosen and not chosen.startswith("ray.util.rpdb."):
        sys.__breakpointhook__(*args, **kwargs)
        return
    worker_pdb().set_trace(sys._getframe(1))


def post_mortem(error: BaseException, tb: TracebackType | None, rank: int) -> None:
    """Open pdb on the frames of `error` from `tb` down, prompting in the cell; return
    when the user continues or quits."""
    summary = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    print(f"rank {rank} raised {summary}: post-mortem debugger ({POST_MORTEM_HELP})", flush=True)
    debugger = worker_pdb()
    debugger.reset()
    with contextlib.suppress(Exception):  # a quit ends the debugger, and so this rank
        debugger.interaction(None, tb or error.__traceback__)


def worker_pdb() -> object:
    """A pdb whose stack starts at the user's code: the frames above it (the worker's
    own, and in a forked worker the launching process's) are left out."""

    class WorkerPdb(_python_pdb_class()):  # type: ignore[misc]
        def get_stack(self, f, t):  # type: ignore[no-untyped-def]
            stack, index = super().get_stack(f, t)
            files = [frame.f_code.co_filename for frame, _ in stack]
            ours = [n for n, file in enumerate(files) if _SCAFFOLDING.search(file)]
            if not ours or ours[-1] >= index:  # stopped in our own code: show it all
                return stack, index
            cut = ours[-1] + 1
            return stack[cut:], index - cut

    # nosigint: the launcher owns the stop button; pdb's own SIGINT handler would not
    # reach a worker, and a live worker's handler must stay.
    return WorkerPdb(nosigint=True)


def _in_debugger(frame: FrameType) -> bool:
    import bdb

    return any(isinstance(f.f_locals.get("self"), bdb.Bdb) for f, _ in traceback.walk_stack(frame))
