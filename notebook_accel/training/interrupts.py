"""A stop request from the notebook that training code can answer at a step boundary.

Interrupting workers where they happen to be can leave one of them inside a
collective its peers have left, waiting for good. When a live worker
(notebook_accel/live) is asked to stop, it first only raises this flag:
`Accelerator.check_trigger()`, Accelerate's early-stopping check, reads it as a
trigger, so a loop that calls it each step stops at the same step on every
worker. Code that does not check in time is interrupted where it runs.
"""

from __future__ import annotations

_requested = False


def request() -> None:
    """Ask the running code to stop at its next `check_trigger()` (from a signal handler)."""
    global _requested
    _requested = True


def requested() -> bool:
    """Whether a stop was asked for and not yet answered."""
    return _requested


def clear() -> None:
    """Forget the request (answered, or the call is over)."""
    global _requested
    _requested = False
