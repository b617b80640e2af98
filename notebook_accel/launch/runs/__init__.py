"""Runs that outlive the kernel: a detached launch, its run directory, attaching to it.

directory.py  where this user's runs live, and each run's record (run.json)
log.py        a run's events, appended as they come, bounded, read by any kernel
starting.py   ship a launch to its run directory and start its keeper
keeper.py     the process that owns a detached run's workers instead of the kernel
handle.py     DetachedRun, attach(), runs(), resume()
"""
