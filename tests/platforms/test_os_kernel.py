"""The old-kernel warning that making an Accelerator gives (huggingface/accelerate#1929)."""

from __future__ import annotations

import logging
import platform

import pytest

from notebook_accel.platforms import os_kernel
from notebook_accel.utils import check_os_kernel


def _uname(monkeypatch, system: str, release: str) -> None:
    real = platform.uname()
    monkeypatch.setattr(platform, "uname", lambda: real._replace(system=system, release=release))


@pytest.mark.parametrize(
    ("system", "release", "warned"),
    [
        ("Linux", "5.4.0-35-generic", True),
        ("Linux", "4.19", True),
        ("Linux", "5.5.0", False),
        ("Linux", "5.15.0-35-generic", False),
        ("Linux", "6.1.0-rpi7", False),
        ("Linux", "unreadable", False),
        ("Darwin", "5.4.0", False),
    ],
)
def test_linux_older_than_5_5_is_warned_about(monkeypatch, caplog, system, release, warned):
    _uname(monkeypatch, system, release)
    with caplog.at_level(logging.WARNING):
        check_os_kernel()
    messages = [r.getMessage() for r in caplog.records]
    assert bool(messages) == warned
    if warned:
        assert "below the recommended minimum of 5.5.0" in messages[0]


def test_only_the_main_process_warns(monkeypatch, caplog):
    _uname(monkeypatch, "Linux", "5.4.0")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING):
        check_os_kernel()
    assert caplog.records == []


def test_an_accelerator_checks_once_per_process(monkeypatch, caplog):
    from notebook_accel import Accelerator

    _uname(monkeypatch, "Linux", "5.4.0")
    os_kernel.check_once.cache_clear()
    with caplog.at_level(logging.WARNING):
        Accelerator(cpu=True)
        Accelerator(cpu=True)
    assert ["5.4.0" in r.getMessage() for r in caplog.records] == [True]
