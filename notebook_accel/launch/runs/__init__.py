"""Runs that outlive the kernel: a detached launch, its run directory, attaching to it.

directory.py  where this user's runs live, each run's record (run.json) and shipped launch
log.py        a run's events, appended as they come, bounded, read by any kernel
keeper.py     the keeper's body, and the keeper process of this machine
detached.py   DetachedRun: follow a run from a kernel, stop it, get its outcome
local.py      LocalRun: a run whose keeper is a process of this machine, started here
on_cluster.py ClusterRun, ClusterKeeper: a run kept by a detached actor of a Ray cluster
handle.py     attach(), runs(), resume()
"""
