"""What a training process reports, and how the kernel folds it into a run's report.

    events.py       the typed events of a run (worker -> kernel)
    destination.py  where this process's metrics, progress and milestones go
    metrics.py      accelerator.log's records; progress.py: progress bars
    logging.py      get_logger, rank-aware
    report.py       RunReport, the one reducer of events (last_run(), the views)
    observers.py    receivers of a run's events: the console, the views

May import: config.
"""
