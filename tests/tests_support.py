"""Helpers shared by the tests."""

from __future__ import annotations

import psutil


def live_children() -> list[psutil.Process]:
    """This process's descendants that are still running (zombies excluded)."""
    alive = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.Error:
            pass
    return alive
