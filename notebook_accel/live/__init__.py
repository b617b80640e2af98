"""Live workers: a process group that stays up between cells, models resident on the devices.

    start.py    start_workers; group.py: LiveWorkers (calls, stops, restarts)
    serve.py    the worker's side: the calls down its link, each run in its namespace
    values.py   values that stay on a worker
    regroup.py  bring ranks out of a collective a peer left, form the group again
    magic.py    %%on_workers

May import: config, platforms, reporting, training, views, launch.
"""

from typing import TYPE_CHECKING

from notebook_accel._lazy import lazy_exports

# public name -> module that defines it (imported on first use: see _lazy.py)
_EXPORTS = {
    "GroupEnded": "notebook_accel.live.group",
    "LiveWorkers": "notebook_accel.live.group",
    "start_workers": "notebook_accel.live.start",
    "ValueOnWorker": "notebook_accel.live.values",
}

if TYPE_CHECKING:
    from notebook_accel.live.group import GroupEnded, LiveWorkers
    from notebook_accel.live.start import start_workers
    from notebook_accel.live.values import ValueOnWorker

__all__ = ["GroupEnded", "LiveWorkers", "ValueOnWorker", "start_workers"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
