"""The Linux kernel check Accelerate makes when an Accelerator is made.

Collectives between processes have been seen to hang on Linux kernels older
than 5.5 (huggingface/accelerate#1929), so the main process warns once.
"""

from __future__ import annotations

import functools
import logging
import platform
import re

from notebook_accel.config.settings import process_rank_and_world

MINIMUM_KERNEL = (5, 5, 0)

logger = logging.getLogger(__name__)


def check_os_kernel() -> None:
    """Warn (main process only) when this is Linux with a kernel older than 5.5.0."""
    info = platform.uname()
    if info.system != "Linux":
        return
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", info.release)
    if found is None:  # a release string we cannot read: nothing to say
        return
    version = tuple(int(part or 0) for part in found.groups())
    if version < MINIMUM_KERNEL and process_rank_and_world()[0] == 0:
        shown = ".".join(map(str, version))
        minimum = ".".join(map(str, MINIMUM_KERNEL))
        logger.warning(
            f"Detected kernel version {shown}, which is below the recommended minimum of "
            f"{minimum}; this can cause the process to hang. It is recommended to upgrade "
            "the kernel to the minimum version or higher."
        )


@functools.cache
def check_once() -> None:
    """`check_os_kernel`, the first time an Accelerator is made in this process."""
    check_os_kernel()
