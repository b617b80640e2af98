"""Live workers: a process group that stays up between cells (live/group.py)."""

from notebook_accel.live.group import GroupEnded, LiveWorkers, start_workers

__all__ = ["GroupEnded", "LiveWorkers", "start_workers"]
