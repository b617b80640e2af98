"""A logger that, in a run of several processes, logs once (on the main process).

logger = get_logger(__name__)
logger.info("starting")                          # main process only
logger.info("my shard", main_process_only=False)  # every process
logger.info("in turn", main_process_only=False, in_order=True)  # rank 0, then 1, ...
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from notebook_accel.config.settings import process_rank_and_world


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only, unless a call passes `main_process_only=False`."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        # The record names the caller's line, not this method's (2: past this frame;
        # logging skips its own LoggerAdapter frames). A caller's own stacklevel wins.
        kwargs.setdefault("stacklevel", 2)
        if not self.isEnabledFor(level):
            return
        msg, kwargs = self.process(msg, kwargs)
        rank, world = process_rank_and_world()
        if main_process_only:
            if rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
        elif in_order and world > 1:
            import torch.distributed as dist

            for turn in range(world):
                if turn == rank:
                    self.logger.log(level, msg, *args, **kwargs)
                dist.barrier()
        else:
            self.logger.log(level, msg, *args, **kwargs)

    @functools.lru_cache(None)  # noqa: B019 - the cache is the point: one warning per message
    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning`, but each distinct message only once."""
        self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A `logging` logger for `name` that logs on the main process only unless asked.

    `log_level` (or the ACCELERATE_LOG_LEVEL environment variable) sets the
    level of this logger and of the root logger.
    """
    logger = logging.getLogger(name)
    log_level = log_level or os.environ.get("ACCELERATE_LOG_LEVEL")
    if log_level is not None:
        logger.setLevel(log_level.upper())
        logging.getLogger().setLevel(log_level.upper())
    return MultiProcessAdapter(logger, {})
