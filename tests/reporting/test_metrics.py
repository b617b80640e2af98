"""Metrics logged outside any launch: kept locally, and only so many."""

from __future__ import annotations

from notebook_accel.reporting import metrics
from notebook_accel.reporting.destination import Destination, current, sending_to


def test_the_local_history_keeps_only_the_newest_records_and_can_be_cleared():
    metrics.clear_local_history()
    try:
        for step in range(metrics.LOCAL_HISTORY_MAXLEN + 25):
            metrics.record({"loss": float(step)}, step=step)
        history = metrics.local_history()
        assert len(history) == metrics.LOCAL_HISTORY_MAXLEN
        assert history[0].step == 25 and history[-1].step == metrics.LOCAL_HISTORY_MAXLEN + 24
        metrics.clear_local_history()
        assert metrics.local_history() == []
    finally:
        metrics.clear_local_history()


def test_an_installed_destination_takes_the_records_and_is_restored_after():
    metrics.clear_local_history()
    received = []
    before = current()
    with sending_to(Destination(metric=received.append)):
        entry = metrics.record({"loss": 1.0}, step=3)
    assert received == [entry] and metrics.local_history() == []
    assert current() is before
    metrics.record({"loss": 2.0})
    assert [r.values for r in metrics.local_history()] == [{"loss": 2.0}]
    metrics.clear_local_history()
