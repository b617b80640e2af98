"""The base of the views: redraws at a bounded rate, and which of them are periodic."""

from __future__ import annotations

import threading

from notebook_accel.reporting.events import AttemptStarted, Progress
from notebook_accel.reporting.report import RunReport
from notebook_accel.views.state import RunView


class Recording(RunView):
    """Records whether each redraw was periodic; the first one waits until released."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []
        self.inside = threading.Event()
        self.release = threading.Event()

    def changed(self, final: bool) -> None:
        self.seen.append((threading.current_thread().name, self.periodic))
        if not self.inside.is_set():
            self.inside.set()
            assert self.release.wait(10)


def test_a_redraw_from_another_thread_during_a_periodic_one_is_not_periodic():
    view, report = Recording(), RunReport()
    event = AttemptStarted(workers=2, attempt=0)  # redraws at once
    launcher = threading.Thread(target=view.on_event, args=(event, report), name="launcher")
    launcher.start()
    assert view.inside.wait(10)
    view.changed(final=False)  # a live group's call ended, on the kernel's thread
    view.release.set()
    launcher.join(10)
    assert view.seen == [("launcher", True), ("MainThread", False)]
    assert not view.periodic


def test_redraws_come_at_most_every_interval_and_at_once_when_workers_start():
    view, report = Recording(), RunReport()
    view.release.set()
    view.interval = 60.0
    view.on_event(AttemptStarted(workers=2, attempt=0), report)
    for step in range(5):
        view.on_event(Progress(rank=0, step=step, total=5, elapsed=0.1), report)
    view.on_event(AttemptStarted(workers=2, attempt=1), report)
    assert [periodic for _, periodic in view.seen] == [True, True]
