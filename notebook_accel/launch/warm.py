"""Warm launches: import here what the last run's workers had to import themselves.

A worker forked from this process inherits every module imported here; what
it imports itself it pays for in every launch (the first torch.optim
optimizer a process builds imports torch._dynamo: seconds). So each worker
reports, at its end, the modules it imported that were not imported when it
was forked (`ModulesImported`), and after the run this process imports the
safe ones on a background thread: the next launch's workers start with them.

Safe means: part of an installed package (not the notebook, not a file next
to it), and not under one of a platform's device packages
(`Platform.device_packages`). While warming imports, a module that would
start CUDA gets an error instead (`Platform.guard_runtime_start`), and after
every import the platforms check this process again (the same check a launch
makes): if a device runtime was started after all, warming stops for the
rest of the process and says why; the next launch refuses as it would after
any cell that did so.

A fork copies a half-done import with its locks held, and the child waits on
them forever. `os.register_at_fork` makes every fork in this process (a
launch, DataLoader workers, multiprocessing) wait for the warming thread
first, so no fork happens while it imports.
"""

from __future__ import annotations

import importlib
import itertools
import os
import signal
import site
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

# Imported by the first torch.optim optimizer a process builds (its
# `_disable_dynamo` decorator imports torch._dynamo on first call): seconds in
# every worker forked from a process that never built one. The panel warms
# these when it is shown.
KNOWN_HEAVY = ("torch._dynamo",)

# How long a fork waits for the warming thread; an import slower than this is stuck.
FORK_WAIT_SECONDS = 60.0
# An interrupt that came while a fork waited is raised again this long after it.
INTERRUPT_AGAIN_SECONDS = 0.01

# The notebook's own code, which runs where it is called and nowhere else.
_NOTEBOOK_MODULES = ("__main__", "__mp_main__")

_MAX_REASON = 200


@dataclass
class Warming:
    """What this process imported after a run so that the next launch's workers have it.

    `status`: "not started", "off" (the launch passed warm=False, or warming
    stopped earlier in this process: `problem` says why), "not needed" (the
    function ran in this process), "running" (on a background thread),
    "done", or "stopped" (an import started a device runtime: `problem` says
    which; the next launch refuses, and warming stays off in this process).
    `modules` are the modules imported here on purpose, in order; `imported`
    counts every module that brought in; `seconds` is what it took (once, in
    the background, instead of in every worker of every launch). `skipped`
    maps a module left alone to the reason.
    """

    status: str = "not started"
    modules: list[str] = field(default_factory=list)
    imported: int = 0
    seconds: float = 0.0
    skipped: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    _finished: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def wait(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for warming to end; True once it has (or never ran)."""
        if self.status == "running":
            return self._finished.wait(timeout)
        return True

    def summary(self) -> str:
        """One line: what was warmed, what it cost, what was skipped."""
        text = (
            f"warming {self.status}: {len(self.modules)} module(s) asked for, "
            f"{self.imported} imported in {self.seconds:.2f} s"
        )
        if self.skipped:
            text += f", {len(self.skipped)} skipped"
        return text + (f" ({self.problem})" if self.problem else "")

    def finish(self, status: str) -> None:
        """Set the final status and wake whoever waits (warming ended, or never ran)."""
        self.status = status
        self._finished.set()


def imported_since(count_at_fork: int) -> tuple[tuple[str, str | None], ...]:
    """The modules imported since `sys.modules` held `count_at_fork` entries, with
    their files, in import order. A worker calls it at its end.

    Only the newest entries are read (sys.modules keeps insertion order):
    touching every module of a forked process would copy the memory pages
    of all of them (copy-on-write, a few milliseconds). A module removed
    since the fork shifts the cut by one, which at worst names a module this
    process already has.
    """
    new = max(0, len(sys.modules) - count_at_fork)
    found = []
    for name, module in reversed(list(itertools.islice(reversed(sys.modules.items()), new))):
        found.append((name, getattr(module, "__file__", None)))
    return tuple(found)


def warm_after_run(imported: Mapping[str, str | None], warming: Warming, enabled: bool) -> None:
    """Import here, in the background, the safe modules among those the workers imported."""
    if not enabled:
        warming.finish("off")
        return
    try:
        names, warming.skipped = choose(imported)
        _WARMER.request(names, warming)
    except Exception as error:  # noqa: BLE001 - called as a run ends: never fail the run for it
        warming.problem = f"{type(error).__name__}: {error}"[:_MAX_REASON]
        warming.finish("stopped")


def warm_known(enabled: bool = True) -> Warming:
    """Warm KNOWN_HEAVY in the background (the panel does when it is shown)."""
    warming = Warming()
    if enabled:
        _WARMER.request(list(KNOWN_HEAVY), warming)
    else:
        warming.finish("off")
    return warming


def choose(imported: Mapping[str, str | None]) -> tuple[list[str], dict[str, str]]:
    """Which of `imported` (name -> file) to import here, and why the others are not.

    Decided from names and files alone, before anything is imported.
    """
    from notebook_accel.platforms import PLATFORMS

    devices = tuple(package for p in PLATFORMS.values() for package in p.device_packages)
    names: list[str] = []
    skipped: dict[str, str] = {}
    for name, origin in imported.items():
        if name in sys.modules:
            continue
        package = next((d for d in devices if name == d or name.startswith(d + ".")), None)
        if package is not None:  # one entry for a package, not one per submodule
            skipped[package] = "a device package: importing it may start a device runtime"
            continue
        reason = _why_not(name, origin)
        if reason:
            skipped[name] = reason
        else:
            names.append(name)
    return names, skipped


def _why_not(name: str, origin: str | None) -> str | None:
    if name in _NOTEBOOK_MODULES or name.startswith("__"):
        return "the notebook's own code"
    if origin is None:
        if name in sys.builtin_module_names:
            return None
        return "no file (a namespace package, or a module made at run time)"
    if not os.path.abspath(origin).startswith(_installed_roots()):
        return "not an installed package (code next to the notebook runs only where it is called)"
    return None


@lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    """Directories of the standard library and of installed packages, notebook_accel's own."""
    paths = sysconfig.get_paths()
    roots = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths]
    roots += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    roots.append(site.getusersitepackages())
    roots.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = {os.path.join(os.path.abspath(r), "") for r in roots if r}
    found |= {os.path.join(os.path.realpath(r), "") for r in roots if r}
    return tuple(sorted(found))


class _Warmer:
    """This process's warming thread: one at a time, taking requests in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[tuple[list[str], Warming]] = []
        self._running = False
        self._thread: threading.Thread | None = None
        # Why warming stopped for good in this process (a device runtime started).
        self.stopped: str | None = None
        self._failed: dict[str, str] = {}
        # Set while no warming thread is at work; forks wait for it.
        self._idle = threading.Event()
        self._idle.set()
        self._interrupted = False

    def request(self, names: list[str], warming: Warming) -> None:
        with self._lock:
            if self.stopped is not None:
                warming.problem = self.stopped
                warming.finish("off")
                return
            for name in [name for name in names if name in self._failed]:
                warming.skipped[name] = self._failed[name]
            names = [name for name in names if name not in self._failed]
            if not names:  # the usual case from the second launch on: no thread at all
                warming.finish("done")
                return
            warming.status = "running"
            self._jobs.append((names, warming))
            if not self._running:
                self._running = True
                self._idle.clear()
                self._thread = threading.Thread(
                    target=self._work, name="notebook_accel-warm", daemon=True
                )
                self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._running = False
                    self._idle.set()
                    return
                names, warming = self._jobs.pop(0)
            try:
                self._warm(names, warming)
            except BaseException as error:  # noqa: BLE001 - the thread must go on to the next job
                warming.problem = f"{type(error).__name__}: {error}"[:_MAX_REASON]
                warming.finish("stopped")

    def _warm(self, names: Iterable[str], warming: Warming) -> None:
        from notebook_accel.platforms import PLATFORMS

        platforms = list(PLATFORMS.values())
        started, before = time.perf_counter(), len(sys.modules)
        unclean_before = _device_problem(platforms)
        me = threading.get_ident()
        undos = [p.guard_runtime_start(lambda: threading.get_ident() == me) for p in platforms]
        status = "done"
        try:
            for name in names:
                if not self._import(name, warming):
                    continue
                problem = _device_problem(platforms)
                if problem is not None and unclean_before is None:
                    self.stopped = f"importing {name} started a device runtime: {problem}"
                    warming.problem = self.stopped
                    status = "stopped"
                    break
        finally:
            for undo in undos:
                undo()
            warming.imported = len(sys.modules) - before
            warming.seconds = time.perf_counter() - started
            warming.finish(status)

    def _import(self, name: str, warming: Warming) -> bool:
        """Import `name` unless it is there already; True when it was imported now."""
        if name in sys.modules:
            return False
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - left for the workers to import themselves
            reason = f"import failed: {type(error).__name__}: {error}"[:_MAX_REASON]
            self._failed[name] = warming.skipped[name] = reason
            return False
        warming.modules.append(name)
        return True

    def wait_before_fork(self) -> None:
        if self._thread is threading.current_thread():
            return  # an imported module forks: it cannot wait for itself
        # An Event, not Thread.join: a join interrupted by KeyboardInterrupt
        # marks the thread stopped while it still runs (Python 3.11, bpo-45274's fix).
        deadline = time.monotonic() + FORK_WAIT_SECONDS
        while not self._idle.is_set() and time.monotonic() < deadline:
            try:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            except KeyboardInterrupt:
                # Raised in an at-fork hook it would be ignored and the fork would
                # go ahead mid-import; it is raised again after the fork instead.
                self._interrupted = True

    def after_fork_in_parent(self) -> None:
        if self._interrupted:
            self._interrupted = False
            # Delivered from another thread a moment later: raised now, it would
            # land in this hook and be ignored.
            threading.Timer(INTERRUPT_AGAIN_SECONDS, _interrupt_main).start()

    def forget_after_fork(self) -> None:
        # In the child: the lock may have been copied held, and the thread is not there.
        self._lock = threading.Lock()
        self._jobs = []
        self._running = False
        self._thread = None
        self._idle = threading.Event()
        self._idle.set()
        self._interrupted = False


def _interrupt_main() -> None:
    # A real SIGINT (not _thread.interrupt_main) also wakes a main thread that sleeps
    # or waits; only sent where a Python handler will turn it into KeyboardInterrupt.
    if callable(signal.getsignal(signal.SIGINT)):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def _device_problem(platforms: list) -> str | None:
    for platform in platforms:
        problem = platform.fork_problem()
        if problem:
            return problem
    return None


_WARMER = _Warmer()


def _before_fork() -> None:
    _WARMER.wait_before_fork()


def _after_fork_in_parent() -> None:
    _WARMER.after_fork_in_parent()


def _after_fork_in_child() -> None:
    _WARMER.forget_after_fork()


# Registered once, when this module is first imported (by the launcher).
os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
