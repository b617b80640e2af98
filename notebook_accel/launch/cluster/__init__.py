"""Workers on a Ray cluster, driven from one kernel (see group.py)."""
