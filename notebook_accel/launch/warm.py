"""Warm launches: the launching process imports what its workers had to import.

A worker forked from this process inherits every module imported here; what
it imports itself it pays for in every launch (the first torch.optim
optimizer a process builds imports torch._dynamo: seconds). So each worker
reports the modules it imported that were not imported when it was forked
(`ModulesImported`): as soon as its training function reaches a milestone
(`prepare()` done, the first optimizer step; reporting/destination.py), and at
its end. This process imports the safe ones, so that the next launch's
workers start with them.

Only on the thread that runs the notebook's code, and never while a launch
is finishing. Two threads importing one package tree are not safe in CPython
(the per-module locks' deadlock detector hands one of them a half-initialised
module; seen as sympy and torch._dynamo ImportErrors in a cell that built an
optimizer right after a launch), and a library may register fork hooks while
it is imported. An import cannot be cut short either (torch._dynamo is one
import of about a second): one begun while the workers run could outlast them
and lengthen the call. So a launch only queues what its workers reported
(a launch ends as soon as its workers have: bench/warm_launch.py), and the
queue is imported:

- in a Jupyter kernel, by callbacks of the kernel's event loop, one module
  each, between cells (also for a launch from another thread, such as the
  panel's Launch button);
- by the next launch on the main thread, before it starts its workers, for
  what is still queued (a loop of launches in one cell, a script);
- outside a kernel, from another thread: not at all.

Each import holds the fork lock (launch/forking.py), so no launch in another
thread forks a copy of a half-done import, and a stop press waits until the
module is whole.

Safe means: part of an installed package (not the notebook, not a file next
to it), and not under one of a platform's device packages
(`Platform.device_packages`). While warming imports, a module that would
start CUDA gets an error instead (`Platform.guard_runtime_start`), and after
every import the platforms check this process again: if a device runtime was
started after all, warming stops for the rest of the process and says why;
the next launch refuses as it would after any cell that did so.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from notebook_accel.launch.forking import guarded
from notebook_accel.launch.packing import installed_roots
from notebook_accel.reporting.report import Warming

# Imported by the first torch.optim optimizer a process builds (its
# `_disable_dynamo` decorator imports torch._dynamo on first call): seconds in
# every worker forked from a process that never built one. The panel warms
# these when it is shown.
KNOWN_HEAVY = ("torch._dynamo",)

# The longest reason warming gives for a module.
MAX_REASON = 200


def imported_since(count: int) -> tuple[tuple[str, str | None], ...]:
    """The modules imported since `sys.modules` held `count` entries, with their
    files, in import order. A worker calls it when it reports.

    Only the newest entries are read (sys.modules keeps insertion order):
    touching every module of a forked process would copy the memory pages
    of all of them (copy-on-write, a few milliseconds). A module removed
    since shifts the cut by one, which at worst names a module this process
    already has.
    """
    newest = itertools.islice(reversed(sys.modules.items()), max(0, len(sys.modules) - count))
    return tuple((name, getattr(module, "__file__", None)) for name, module in [*newest][::-1])


class RunWarmer:
    """One launch's warming: takes the workers' reports, imports on the right thread."""

    def __init__(self, warming: Warming, enabled: bool, here: bool | None = None):
        self.warming = warming
        # Whether this thread may import: the main one runs the notebook's code.
        self._here = threading.current_thread() is threading.main_thread() if here is None else here
        if not enabled:
            warming.finish("off")
        elif _PROCESS.stopped is not None:
            warming.problem = _PROCESS.stopped
            warming.finish("off")

    @property
    def active(self) -> bool:
        return self.warming.status in ("not started", "running")

    def offer(self, imported: Iterable[tuple[str, str | None]]) -> None:
        """Queue the safe modules among those a worker reported it imported."""
        if not self.active:
            return
        try:
            names, skipped = choose(dict(imported))
        except Exception as error:  # noqa: BLE001 - never fail a run for its warming
            self.warming.problem = f"{type(error).__name__}: {error}"[:MAX_REASON]
            _forget(self.warming)
            self.warming.finish("stopped")
            return
        self.warming.skipped.update(skipped)
        for name in names:
            if name in _PROCESS.failed:
                self.warming.skipped[name] = _PROCESS.failed[name]
            elif name not in self.warming.pending:
                self.warming.pending.append(name)
        if self.warming.pending and self.warming not in _PROCESS.queued:
            _PROCESS.queued.append(self.warming)

    def start(self) -> bool:
        """Import, on the main thread, what earlier launches left queued, so that this
        launch's workers start with it. True if an import started a device runtime after
        all (warming stopped): this process can then no longer fork device workers. On a
        stop press, KeyboardInterrupt once the module being imported is whole."""
        if not (self._here and self.active and _PROCESS.queued):
            return False
        try:
            while _import_next(credit=self.warming):
                pass
        except KeyboardInterrupt:
            self._end("interrupted")
            raise
        return self.warming.status == "stopped"

    def drain(self) -> None:
        """Import this launch's queue now, where no notebook waits (a cluster node's agent)."""
        if self._here and self.active:
            while self.warming.pending and _import_next(credit=self.warming):
                pass
            self._end("done")

    def finish(self, interrupted: bool) -> None:
        """The launch ends: leave what it queued to the kernel's event loop, or to the
        next launch on the main thread; never import here (that would lengthen the call)."""
        if not self.active:
            return
        if interrupted:
            _forget(self.warming)
            self._end("interrupted")
        elif not self.warming.pending:
            self._end("done")
        elif _schedule_on_kernel_loop():
            self.warming.status = "deferred"
        elif self._here:
            self.warming.status = "next launch"
        else:
            _forget(self.warming)
            self.warming.problem = (
                "launched from a thread other than the main one, outside a Jupyter kernel: "
                "importing there could race the code on the main thread"
            )
            self.warming.finish("off")

    def _end(self, status: str) -> None:
        if self.warming.status in ("not started", "running", "deferred", "next launch"):
            self.warming.finish(status)


def _import_next(credit: Warming) -> bool:
    """Import the first module queued, crediting its time to `credit`; False when the queue
    is empty or warming stopped. The launches whose queues it empties are done."""
    queued = _PROCESS.queued  # each with something pending
    if not queued or _PROCESS.stopped is not None:
        return False
    from notebook_accel.platforms.registry import PLATFORMS

    name, platforms, problem = queued[0].pending[0], list(PLATFORMS.values()), None
    if credit.status == "not started":
        credit.status = "running"
    before, started = len(sys.modules), time.perf_counter()
    try:
        with guarded():  # no fork copies it half done; a stop press waits for it
            if name not in sys.modules:
                unclean_before = device_problem(platforms)
                me = threading.get_ident()
                failed = import_refusing_devices(
                    name, platforms, lambda: threading.get_ident() == me
                )
                if failed is not None:
                    _PROCESS.failed[name] = credit.skipped[name] = failed
                else:
                    credit.modules.append(name)
                    problem = device_problem(platforms) if unclean_before is None else None
    finally:
        credit.seconds += time.perf_counter() - started
        credit.imported += len(sys.modules) - before
        for warming in list(queued):
            if name in warming.pending:
                warming.pending.remove(name)
            if not warming.pending:
                queued.remove(warming)
                _finish_queued(warming, "done")
    if problem is not None:
        _PROCESS.stopped = f"importing {name} started a device runtime: {problem}"
        credit.problem = _PROCESS.stopped[:MAX_REASON]
        for warming in [credit, *queued]:
            _forget(warming)
            warming.problem = credit.problem
            warming.finish("stopped")
    return problem is None


def _deferred_step() -> None:
    # On the kernel's main thread, between cells: one module per callback, so
    # that a cell or a widget click waiting to run goes first.
    _PROCESS.loop_scheduled = False
    if not _PROCESS.queued:
        return
    try:
        more = _import_next(credit=_PROCESS.queued[0])
    except KeyboardInterrupt:
        for warming in list(_PROCESS.queued):
            _forget(warming)
            _finish_queued(warming, "interrupted")
        return
    if more and _PROCESS.queued:
        _schedule_on_kernel_loop()


def _schedule_on_kernel_loop() -> bool:
    """Have the Jupyter kernel's event loop import the queue between cells (from any thread);
    False outside a kernel."""
    if _PROCESS.loop_scheduled or "ipykernel" not in sys.modules:  # never import IPython
        return _PROCESS.loop_scheduled
    with contextlib.suppress(Exception):  # a kernel without the loop we know
        from IPython import get_ipython

        loop = getattr(getattr(get_ipython(), "kernel", None), "io_loop", None)
        if loop is not None:
            loop.add_callback(_deferred_step)
            _PROCESS.loop_scheduled = True
    return _PROCESS.loop_scheduled


def _finish_queued(warming: Warming, status: str) -> None:
    # A launch still running keeps its own status until its finish().
    if warming.status in ("deferred", "next launch"):
        warming.finish(status)


def _forget(warming: Warming) -> None:
    warming.pending.clear()
    if warming in _PROCESS.queued:
        _PROCESS.queued.remove(warming)


# What every launch's workers run: the process that forks them imports it first (the
# kernel before its first fork launch, the template process at its start), so that no
# worker imports it again (tens of milliseconds each), whether or not warming is on.
WORKER_CODE = ("torch.distributed", "notebook_accel.accelerator.accelerator")


def import_worker_code() -> None:
    """Import WORKER_CODE here, on the main thread only (the rule every import for the
    workers keeps), under the fork lock; at once when it is already imported."""
    missing = [name for name in WORKER_CODE if name not in sys.modules]
    if not missing or threading.current_thread() is not threading.main_thread():
        return
    with guarded():
        for name in missing:
            importlib.import_module(name)


def warm_known(enabled: bool = True) -> Warming:
    """Import KNOWN_HEAVY on the kernel's main thread between cells (the panel does
    when it is shown, from a cell: the imports run once that cell has ended)."""
    warming = Warming()
    # Not here: the cell that shows the panel would wait for the imports.
    warmer = RunWarmer(warming, enabled, here=False)
    if warmer.active:
        found = (importlib.util.find_spec(name) for name in KNOWN_HEAVY)
        warmer.offer((spec.name, spec.origin) for spec in found if spec is not None)
        warmer.finish(interrupted=False)
    return warming


def choose(imported: Mapping[str, str | None]) -> tuple[list[str], dict[str, str]]:
    """Which of `imported` (name -> file) to import here, and why the others are not:
    decided from names and files alone, before anything is imported."""
    from notebook_accel.platforms.registry import known_device_packages

    devices = known_device_packages()
    names: list[str] = []
    skipped: dict[str, str] = {}
    for name, origin in imported.items():
        if name in sys.modules:
            continue
        package = next((d for d in devices if name == d or name.startswith(d + ".")), None)
        if package is not None:  # one entry for a package, not one per submodule
            skipped[package] = "a device package: importing it may start a device runtime"
        elif name.startswith("__"):  # __main__, __mp_main__: it runs where it is called
            skipped[name] = "the notebook's own code"
        elif origin is None and name not in sys.builtin_module_names:
            skipped[name] = "no file (a namespace package, or a module made at run time)"
        elif origin is not None and not os.path.abspath(origin).startswith(installed_roots()):
            skipped[name] = (
                "not an installed package (code next to the notebook runs only where it is called)"
            )
        else:
            names.append(name)
    return names, skipped


@dataclass
class _ProcessWarming:
    """What warming learnt in this process, for every later launch."""

    # Why warming stopped for good (a device runtime started while it imported).
    stopped: str | None = None
    # Modules whose import failed here, with the reason: not tried again.
    failed: dict[str, str] = field(default_factory=dict)
    # The launches with modules left to import (each its `pending`), oldest first.
    queued: list[Warming] = field(default_factory=list)
    # Whether the kernel's event loop has a `_deferred_step` to call.
    loop_scheduled: bool = False


_PROCESS = _ProcessWarming()


def import_refusing_devices(name: str, platforms: list, refuse: Callable[[], bool]) -> str | None:
    """Import `name` while `refuse()` makes starting any of `platforms`' device runtimes
    raise (the template imports with it too); why the import failed, or None."""
    undos = [platform.guard_runtime_start(refuse) for platform in platforms]
    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - left for the workers to import themselves
        return f"import failed: {type(error).__name__}: {error}"[:MAX_REASON]
    finally:
        for undo in undos:
            undo()
    return None


def device_problem(platforms: list) -> str | None:
    """The first of `platforms`' reasons a fork would be unsafe now, if any."""
    return next(filter(None, (platform.fork_problem() for platform in platforms)), None)
