"""Live workers: a process group that stays up between cells (live/group.py)."""

from notebook_accel.live.group import GroupEnded, LiveWorkers, start_workers
from notebook_accel.live.values import ValueOnWorker

__all__ = ["GroupEnded", "LiveWorkers", "ValueOnWorker", "start_workers"]
