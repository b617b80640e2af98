"""Workers forked from a clean template process, for a kernel that can no longer fork them.

Start method "forkserver": rather than a fresh interpreter per worker ("spawn",
launch/fresh.py), which imports torch again in every launch (about 1.5-2 s), the
first launch that needs it starts one fresh interpreter, the template, which
imports torch and the worker's code once and then forks the workers of this
launch and of every later one.

The template is started with `subprocess` (an exec: nothing of the kernel's
runtime comes along) and never initialises CUDA or another device runtime.
Over a Unix socketpair (launch/template_server.py is its side) the kernel asks
it to fork a worker, handing it the worker's descriptors and the kernel's
current os.environ, working directory, sys.path and torch's CPU random state,
which a forked worker would have (variables torch reads when imported keep the
value they had when the template started, as in a forked worker); or to import
modules for later workers (`preload`). The answer to a fork is the worker's pid
and a pidfd opened before the template could reap it (the supervisor's
sentinel, free of pid-reuse races); its exit status follows once it is reaped.

The template exits, ending its workers, when its socket closes
(`shutdown_template()`, also at exit, or the kernel's exit). If the kernel
dies, even by SIGKILL, Linux kills the template (PR_SET_PDEATHSIG), and its
workers with it. The launch's janitor (launch/forking.py) still ends every
worker's group.

If no template can be used (it cannot start, or a new one fails again right
after the previous one died), the launch does not fail: its workers, and those
of later launches until `shutdown_template()`, start in fresh interpreters
("spawn") with a TemplateWarning saying why. Launches from several threads
share one template.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import itertools
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from notebook_accel.launch.forking import forget_parent_only, parent_only
from notebook_accel.launch.fresh import FreshProcess, in_memory_file, read_all
from notebook_accel.launch.processes import bootstrap, start_interpreter
from notebook_accel.launch.template_server import EXIT_SECONDS, close_all, receive, send

# Importing torch in a fresh interpreter takes about 2 s; far longer on a busy machine.
START_SECONDS = 120.0
# How long a request waits for its answer: the template may be inside one import.
ANSWER_SECONDS = 60.0

_BOOTSTRAP = bootstrap("notebook_accel.launch.template_server", "template_main")
# Modules per message, so that one message stays far below the socket's buffer.
_MODULES_PER_MESSAGE = 200
_STDERR_TAIL = 2000


class TemplateUnavailable(RuntimeError):
    """No template process can fork this worker (it could not start, or died)."""


class TemplateWarning(RuntimeWarning):
    """Workers start in fresh interpreters because the template process cannot be used."""


@dataclass
class TemplateStatus:
    """The template process and what it did (`template_status()`).

    `pid`: the running template's, None when none runs. `start_seconds`: what
    its start took (a fresh interpreter importing torch). `workers`: workers it
    forked. `warmed`: modules it imported for its workers (`preload`), in
    order, which took `warm_seconds` and brought in `imported` modules in all;
    `skipped` maps a module left alone to why. `problem`: why it stopped
    warming and takes no more workers (the next launch replaces it), or why no
    template can be used. `replaced`: why the one before it was replaced.
    """

    pid: int | None = None
    start_seconds: float = 0.0
    workers: int = 0
    warmed: list[str] = field(default_factory=list)
    warm_seconds: float = 0.0
    imported: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    problem: str | None = None
    replaced: str | None = None

    def summary(self) -> str:
        """One line: which template, what it forked and warmed, and any problem."""
        problem = f"; {self.problem}" if self.problem else ""
        if self.pid is None:
            return "no template process" + problem
        return (
            f"template process {self.pid}: started in {self.start_seconds:.2f} s, "
            f"{self.workers} worker(s) forked, {len(self.warmed)} module(s) warmed "
            f"({self.imported} imported in {self.warm_seconds:.2f} s), "
            f"{len(self.skipped)} skipped{problem}"
        )


class TemplateProcess(FreshProcess):
    """One worker forked from the template (a `processes.ProcessHandle`); started as a
    `fresh.FreshProcess` instead, with a TemplateWarning, when no template can be used."""

    _template: _Template | None = None
    _worker = -1  # its number at the template: pids may be reused, numbers are not
    _exitcode: int | None = None

    def start(self) -> None:
        """Have the template fork the worker (starting the template on first need)."""
        context_fd = _kernel_context()
        fds = [self._spec_fd, context_fd, *self._pipes.fds()]
        try:
            try:
                template = _template_for_launch()
                self.pid, self.sentinel, self._worker = template.fork(fds, self._local_rank)
            except TemplateUnavailable:  # found dead: replaced once
                template = _template_for_launch()
                self.pid, self.sentinel, self._worker = template.fork(fds, self._local_rank)
            self._template = template
        except TemplateUnavailable as error:
            warnings.warn(
                f"The workers start in fresh interpreters instead (about 1.5 s slower each "
                f"launch): {error}",
                TemplateWarning,
                stacklevel=2,
            )
            super().start()
        finally:
            os.close(context_fd)

    @property
    def exitcode(self) -> int | None:
        if self._template is None:
            return super().exitcode
        self.join(0.0)
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self._template is None:
            super().join(timeout)
        elif self._exitcode is None and self.sentinel >= 0:
            self._exitcode = self._template.exitcode_of(self._worker, self.sentinel, timeout)

    def close(self) -> None:
        if self._template is not None and self.sentinel >= 0:
            with _STATE.lock:
                self._template.forget(self._worker)
                _close_unused()
        super().close()


def preload(modules: Iterable[str | tuple[str, str | None]]) -> None:
    """Have the template, and every one started later, import `modules` (names, or
    (name, file) pairs as workers report them), so that the workers it forks start
    with them; `template_status()` says what it imported and skipped. Returns at once.

    Nothing is imported in this process: a name without a file is looked up here
    only when that imports nothing (a top-level module, or one whose package is
    imported here).
    """
    wanted = dict((item, _origin(item)) if isinstance(item, str) else item for item in modules)
    with _STATE.lock:
        known = _STATE.wanted.keys() | _STATE.refused
        new = {name: origin for name, origin in wanted.items() if name not in known}
        _STATE.wanted.update(new)
        current = _STATE.current
    if current is not None and new:
        with contextlib.suppress(TemplateUnavailable):  # the next template gets them
            current.preload(new)


def template_status() -> TemplateStatus:
    """The running template's status (a copy), or why none can be used."""
    with _STATE.lock:
        current, broken, replaced = _STATE.current, _STATE.broken, _STATE.replaced
    if current is None:
        return TemplateStatus(problem=broken, replaced=replaced)
    current.poll()
    status = current.status  # its lists are copied at once: a reading thread may extend them
    return dataclasses.replace(
        status, warmed=list(status.warmed), skipped=dict(status.skipped), replaced=replaced
    )


def probe(modules: Iterable[str] = ()) -> dict[str, Any] | None:
    """Ask the running template about itself; None when none runs (starts nothing).
    Its "pid", "cuda_initialized" (torch.cuda.is_initialized() there), "device_problem"
    (why a fork of it could not use a device, or None), "threads" (its threads), and
    "imported": which of `modules` it has."""
    with _STATE.lock:
        current = _STATE.current
    if current is None or current.gone:
        return None
    answer, received = current.request({"kind": "probe", "modules": list(modules)}, [])
    close_all(received)
    return {key: value for key, value in answer.items() if key not in ("kind", "id")}


def shutdown_template() -> None:
    """End the template process (and any worker it still runs) and reap it; also at exit.
    The next launch that needs one starts a new one; what `preload` asked for is forgotten."""
    with _STATE.lock:
        templates = [t for t in (_STATE.current, *_STATE.retired) if t is not None]
        _STATE.current, _STATE.retired, _STATE.broken, _STATE.replaced = None, [], None, None
        _STATE.wanted.clear()
        _STATE.refused.clear()
    for template in templates:
        template.close()


@dataclass
class _State:
    """The templates of this process."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    current: _Template | None = None
    # Replaced templates whose workers still run: closed once those are.
    retired: list[_Template] = field(default_factory=list)
    # Why no template could start: later launches start fresh interpreters at once.
    broken: str | None = None
    replaced: str | None = None
    # Every module preload() asked for, for every template started later, and
    # those whose import started a device runtime (never asked for again).
    wanted: dict[str, str | None] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)


_STATE = _State()


def _forget_in_child() -> None:
    # A process forked from this one (a forked worker) has copies of the sockets:
    # it drops them without closing (a worker closes them as `parent_only`) and
    # never touches the template.
    global _STATE
    for template in (_STATE.current, *_STATE.retired):
        if template is not None:
            template.abandon()
    _STATE = _State()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(shutdown_template)


def _template_for_launch() -> _Template:
    """The running template, or a new one if there is none (or it died, or retired)."""
    with _STATE.lock:
        current = _STATE.current
        if current is not None:
            current.poll()
            why = current.unusable()
            if why is not None:  # out of use: it ends once its workers have
                _STATE.current, _STATE.replaced = None, why
                _STATE.retired.append(current)
        _close_unused()
        if _STATE.current is not None:
            return _STATE.current
        if _STATE.broken is not None:
            raise TemplateUnavailable(_STATE.broken)
        current = _Template()
        try:
            current.start()
        except TemplateUnavailable as error:
            _STATE.broken = str(error)
            raise
        _STATE.current = current
        wanted = {n: o for n, o in _STATE.wanted.items() if n not in _STATE.refused}
    if wanted:
        with contextlib.suppress(TemplateUnavailable):  # then the fork finds it gone too
            current.preload(wanted)
    return current


def _close_unused() -> None:
    """Close the retired templates whose workers have all ended (call with the lock held)."""
    for template in [t for t in _STATE.retired if t.users == 0]:
        _STATE.retired.remove(template)
        template.close()


def _kernel_context() -> int:
    """An in-memory file with what a worker forked from this process now would share."""
    cwd = None
    with contextlib.suppress(OSError):  # deleted: the worker stays where the template is
        cwd = os.getcwd()
    torch = sys.modules.get("torch")
    rng = bytes(torch.get_rng_state().tolist()) if hasattr(torch, "get_rng_state") else None
    context = {"environ": dict(os.environb), "cwd": cwd, "path": list(sys.path), "rng": rng}
    return in_memory_file("notebook_accel-worker-context", pickle.dumps(context, protocol=5))


def _origin(name: str) -> str | None:
    """The file of module `name`, found without importing anything; None if unknown."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    parent = name.rpartition(".")[0]
    if parent and parent not in sys.modules:  # finding it would import its package here
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None or spec.origin in ("built-in", "frozen") else spec.origin


def _start_from_lasting_thread(sock: int, stderr: int) -> tuple[subprocess.Popen, threading.Event]:
    """Start the template's interpreter from a thread that lasts until the returned event
    is set: Linux sends a PR_SET_PDEATHSIG signal when the thread that started a process
    ends, not its process; started from a launch's own thread (the panel's), the template
    would be killed when that launch ends."""
    started: concurrent.futures.Future[subprocess.Popen] = concurrent.futures.Future()
    release = threading.Event()

    def run() -> None:
        try:
            kernel = os.getpid()  # which it dies with
            popen = start_interpreter(
                _BOOTSTRAP, sock, kernel, stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(sock,)
            )
            started.set_result(popen)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            started.set_exception(error)
        release.wait()

    threading.Thread(target=run, name="notebook_accel-template-parent", daemon=True).start()
    try:
        return started.result(START_SECONDS), release
    except Exception as error:
        release.set()
        why = "" if isinstance(error, concurrent.futures.TimeoutError) else f": {error}"
        raise TemplateUnavailable(f"its interpreter could not be started{why}") from None


class _Template:
    """The kernel's handle on one template process.

    Its messages are read by whichever thread needs one (a launch waiting for a fork's
    answer, a supervisor asking for an exit status), one reader at a time, the others
    waiting on a condition: each message is filed (answers by request, exit statuses
    by worker number) for its waiter."""

    def __init__(self) -> None:
        self.status = TemplateStatus()
        self.users = 0  # workers forked from it and not closed yet
        self.gone = False  # its socket closed: it exited
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen | None = None
        self._release: threading.Event | None = None
        self._ready = False
        self._ids = itertools.count()
        self._answers: dict[int, tuple[dict, list[int]]] = {}
        self._exits: dict[int, int] = {}  # worker number -> exit status
        self._cond = threading.Condition()
        self._reading = False
        self._send_lock = threading.Lock()

    def start(self) -> None:
        """Start the template and wait until it is ready (bounded)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        parent_only(ours.fileno())  # a worker forked from this process must not hold it
        # Its errors land here: read back for the message if it cannot start.
        stderr = os.memfd_create("notebook_accel-template-stderr", os.MFD_CLOEXEC)
        started = time.perf_counter()
        try:
            with contextlib.closing(theirs):
                self._popen, self._release = _start_from_lasting_thread(theirs.fileno(), stderr)
            self.status.pid = self._popen.pid
            if not self._wait_for(lambda: self._ready, START_SECONDS):
                code = None
                with contextlib.suppress(subprocess.TimeoutExpired):  # its socket closes first
                    code = self._popen.wait(EXIT_SECONDS if self.gone else 0)
                why = self.status.problem or (
                    f"it was not ready within {START_SECONDS:.0f} s"
                    if code is None
                    else f"it exited with code {code}"
                )
                tail = read_all(stderr).decode(errors="replace").strip()[-_STDERR_TAIL:]
                raise TemplateUnavailable(
                    f"the template process could not start: {why}"
                    + (f"; it wrote:\n{tail}" if tail else "")
                )
        except TemplateUnavailable:
            self.close()
            raise
        finally:
            os.close(stderr)
        self.status.start_seconds = time.perf_counter() - started

    def close(self) -> None:
        """Close its socket (it ends its workers and exits), reap it (bounded); once."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # also wakes a thread reading it
            with self._cond:
                self._cond.wait_for(lambda: not self._reading, EXIT_SECONDS)
                forget_parent_only(self._sock.fileno())
                self._sock.close()
                self._sock = None
                self.gone = True
                for _, fds in self._answers.values():
                    close_all(fds)
                self._answers.clear()
        if self._popen is not None:
            try:
                self._popen.wait(EXIT_SECONDS)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()  # SIGKILL ends it at once
        if self._release is not None:
            self._release.set()
        self.status.pid = None

    def abandon(self) -> None:
        """In a forked child: forget the socket without closing it (see `_forget_in_child`)."""
        if self._sock is not None:
            self._sock.detach()
            self._sock = None
        self._popen = None

    def unusable(self) -> str | None:
        """Why no more workers may be forked from it (call `poll()` first), or None."""
        code = None if self._popen is None else self._popen.poll()
        if code is not None:
            return f"the template process had exited (code {code})"
        if self.gone:
            return "the template process had exited"
        return self.status.problem

    def fork(self, fds: list[int], local_rank: int) -> tuple[int, int, int]:
        """Have it fork a worker with `fds`: (pid, pidfd, worker number). TemplateUnavailable
        when it died or refused (it is then retired), OSError when the fork failed."""
        answer, received = self.request({"kind": "fork", "local_rank": local_rank}, fds)
        if answer["kind"] == "forked" and len(received) == 1:
            with self._cond:
                self.users += 1
                self.status.workers += 1
            return answer["pid"], received[0], answer["id"]
        close_all(received)
        if answer["kind"] == "failed":
            raise OSError(f"the template process could not fork a worker: {answer['error']}")
        raise self._retire(answer.get("reason") or "it refused the worker")

    def preload(self, modules: dict[str, str | None]) -> None:
        """Send modules to import (in messages of a bounded size)."""
        items = iter(modules.items())
        while chunk := dict(itertools.islice(items, _MODULES_PER_MESSAGE)):
            self._send({"kind": "preload", "modules": chunk})

    def request(self, message: dict, fds: list[int]) -> tuple[dict, list[int]]:
        """Send `message` with `fds`; its answer, and the descriptors that came with it."""
        request = next(self._ids)
        self._send({**message, "id": request}, fds)
        self._wait_for(lambda: request in self._answers, ANSWER_SECONDS)
        with self._cond:
            if request in self._answers:
                return self._answers.pop(request)
        raise self._retire(
            "the template process exited"
            if self.gone
            else f"the template process did not answer within {ANSWER_SECONDS:.0f} s"
        )

    def _send(self, message: dict, fds: list[int] | tuple = ()) -> None:
        deadline = time.monotonic() + ANSWER_SECONDS
        with self._send_lock:
            while True:
                sock = self._sock
                if sock is None or self.gone:
                    raise TemplateUnavailable("the template process exited")
                try:
                    send(sock, message, fds, socket.MSG_DONTWAIT)
                    return
                except BlockingIOError:  # its buffer is full: it is busy importing
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    select.select([], [sock], [], remaining)
                except OSError as error:  # it died
                    self._retire(f"the template process exited ({error})")
                    raise TemplateUnavailable("the template process exited") from error
        raise self._retire(
            f"the template process did not take a request within {ANSWER_SECONDS:.0f} s"
        )

    def _retire(self, why: str) -> TemplateUnavailable:
        """Take no more workers (the first reason is kept); the error that says `why`."""
        if self.status.problem is None:
            self.status.problem = why
        return TemplateUnavailable(why)

    def exitcode_of(self, worker: int, pidfd: int, timeout: float | None) -> int | None:
        """The exit status of the worker numbered `worker`, waiting at most `timeout`
        seconds for it (None: for as long as it takes); None while it runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wait_for(lambda: worker in self._exits, timeout)
        with self._cond:
            if worker in self._exits:
                return self._exits[worker]
        if not self.gone:
            return None
        # The template died, so no status will come; the worker dies with it
        # (PR_SET_PDEATHSIG), by SIGKILL.
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select([pidfd], [], [], remaining)
        return -signal.SIGKILL if readable else None

    def forget(self, worker: int) -> None:
        """The worker numbered `worker` was closed: drop its status."""
        with self._cond:
            self._exits.pop(worker, None)
            self.users = max(0, self.users - 1)

    def poll(self) -> None:
        """Read what it has sent so far, without waiting."""
        self._wait_for(lambda: False, 0.0)

    def _wait_for(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Read and file its messages until `ready()` (checked under the lock), for
        at most `timeout` seconds (None: no limit; 0: what has arrived); ready()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not ready() and not self.gone:
                remaining = None if deadline is None else deadline - time.monotonic()
                if self._reading:  # another thread reads: it files our message too
                    if remaining is not None and remaining <= 0:
                        break
                    self._cond.wait(remaining)
                    continue
                self._reading = True
                self._cond.release()
                received: list[tuple[dict, list[int]]] = []
                try:
                    received = self._receive(None if remaining is None else max(0.0, remaining))
                finally:
                    self._cond.acquire()
                    self._reading = False
                    for message, fds in received:
                        self._file(message, fds)
                    self._cond.notify_all()
                if remaining is not None and remaining <= 0:
                    break
            return ready()

    def _receive(self, timeout: float | None) -> list[tuple[dict, list[int]]]:
        """Wait up to `timeout` for the socket, then read every message it holds."""
        try:
            select.select([self._sock], [], [], timeout)
            received, closed = receive(self._sock)
        except (OSError, ValueError):  # closed or reset: it is gone
            received, closed = [], True
        if closed:  # it exited
            self.gone = True
        return received

    def _file(self, message: dict, fds: list[int]) -> None:
        """Put one message where its waiter looks (call with the lock held)."""
        kind = message["kind"]
        if "id" in message:  # an answer to a request
            self._answers[message["id"]] = (message, fds)
            return
        close_all(fds)
        if kind == "exit":
            self._exits[message["worker"]] = message["code"]
        elif kind == "ready":
            self._ready = True
        elif kind == "unusable":
            self._retire(message["reason"])
        elif kind == "warmed":
            self.status.warmed.append(message["module"])
            self.status.warm_seconds += message["seconds"]
            self.status.imported += message["imported"]
        elif kind == "skipped":
            self.status.skipped.update(message["modules"])
        elif kind == "stopped":
            # No lock for the set: _STATE.lock is taken before this one elsewhere.
            _STATE.refused.add(message["module"])
            self._retire(message["reason"])
