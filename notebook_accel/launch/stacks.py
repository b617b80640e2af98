"""Where each worker is, when a run makes no progress: their Python stacks, read and told.

Every worker registers faulthandler on `STACK_SIGNAL`: on that signal the
interpreter writes every thread's Python stack to the worker's stderr from C,
so it answers even while the worker waits inside a collective that never
returns (a Python signal handler would wait for it). The launcher sends the
signal when the workers have made no progress for a while, or when Stop is
pressed on a run that is stuck, reads the stacks out of their stderr
(`StackCapture`), and shows for each rank where it is (`explain`): the
collective it waits in, if any, and the line of the notebook that called it.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field

# The signal a worker answers with its stacks (SIGUSR1 is often taken by tools).
STACK_SIGNAL = signal.SIGUSR2

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
# What else faulthandler writes inside a dump.
_OTHER_DUMP_LINES = ("  <no Python frame>", "  ...", "")

# torch.distributed's collectives, as they appear as functions in a stack.
_COLLECTIVES_FILE = "torch/distributed/distributed_c10d.py"
# The worker's own entry: in the stack of the thread that runs the user's function.
_WORKER_FILE = "notebook_accel/launch/worker.py"
_OWN = "/notebook_accel/"
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
        return any(part in self.file for part in ("site-packages/", "/lib/python3", _OWN))

    def show(self) -> str:
        marker = "->" if not self.in_libraries else "  "
        return f"{marker} {self.file}, line {self.line}, in {self.function}"


@dataclass
class StackCapture:
    """One worker's stderr lines that belong to a stack dump, taken out of its output
    while a dump is awaited. `threads`: each thread's frames, innermost first."""

    awaited: bool = False
    threads: list[list[Frame]] = field(default_factory=list)
    _filling: list[Frame] | None = None

    def expect(self) -> None:
        """A dump was asked for: its lines are taken from now on."""
        self.awaited, self._filling, self.threads = True, None, []

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


def collective_of(frames: list[Frame]) -> str | None:
    """The torch.distributed collective the stack waits in (innermost first), if any."""
    waiting = [f.function for f in frames if f.file.endswith(_COLLECTIVES_FILE)]
    return waiting[-1] if waiting else None  # the outermost: the one the user called


def user_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame of the user's own code (a notebook cell or a local file)."""
    return next((f for f in frames if not f.in_libraries), None)


def explain(reason: str, stacks: dict[int, list[Frame]], ended: dict[int, str]) -> str:
    """What the cell shows: for each rank where it is, then who waits for whom, then each
    rank's stack (innermost first; the notebook's own lines marked with ->)."""
    lines = [f"notebook_accel: {reason}. Where each rank is:"]
    waiting: dict[str, list[int]] = {}
    elsewhere: list[int] = []
    for rank in sorted({*stacks, *ended}):
        if rank in ended:
            lines.append(f"  rank {rank}: {ended[rank]}")
            elsewhere.append(rank)
            continue
        frames = stacks[rank]
        collective = collective_of(frames)
        mine = user_frame(frames)
        at = f"{mine.function} ({mine.file}, line {mine.line})" if mine else "no frame of yours"
        if not frames:
            lines.append(f"  rank {rank}: did not answer (busy in native code without Python)")
            elsewhere.append(rank)
        elif collective:
            lines.append(
                f"  rank {rank}: waits in torch.distributed.{collective}, called from {at}"
            )
            waiting.setdefault(collective, []).append(rank)
        elif frames[0] is mine:
            lines.append(f"  rank {rank}: not in a collective, at {at}")
            elsewhere.append(rank)
        else:
            inner = f"{frames[0].function} ({frames[0].file}, line {frames[0].line})"
            lines.append(f"  rank {rank}: not in a collective: in {inner}, called from {at}")
            elsewhere.append(rank)
    lines += _who_waits(waiting, elsewhere)
    for rank in sorted(stacks):
        if stacks[rank]:
            lines.append(f"rank {rank}'s stack, innermost first:")
            lines += ["  " + frame.show() for frame in stacks[rank]]
    lines.append(
        "A collective waits until every rank of the group calls the same one; to have torch "
        "check that they match (and name the mismatch), run with "
        "TORCH_DISTRIBUTED_DEBUG=DETAIL in the workers' environment."
    )
    return "\n".join(lines) + "\n"


def _who_waits(waiting: dict[str, list[int]], elsewhere: list[int]) -> list[str]:
    """One line on who waits for whom."""
    if not waiting:
        return []
    ranks = lambda numbers: ", ".join(map(str, numbers))  # noqa: E731
    if len(waiting) > 1:
        each = "; ".join(f"rank {ranks(r)} in {name}" for name, r in waiting.items())
        return [
            f"  The ranks wait in different collectives ({each}): they call collectives in "
            "a different order, or one calls one more (a longer loop, an extra batch)."
        ]
    ((name, waiters),) = waiting.items()
    if elsewhere:
        return [f"  Rank {ranks(waiters)} wait(s) in {name} for rank {ranks(elsewhere)}."]
    return []
