"""`testaccel`: a multi-device torch device type for the test suite.

Importing this package builds (once, into a cache outside the checkout) and loads a
small C++ extension that gives torch a device type named "testaccel" on the PrivateUse1
dispatch key: N devices (env NOTEBOOK_ACCEL_TEST_DEVICES, default 4) whose memory is
host memory, whose kernels are the CPU kernels, whose streams and events complete at
once, with per-device allocator statistics (nominal total memory per device: env
NOTEBOOK_ACCEL_TEST_DEVICE_MEMORY bytes, default 8 GiB), per-device random generators and
bfloat16 autocast. It registers the device module (`torch.testaccel`, this package's
`device_module`), the tensor methods (`tensor.testaccel()`, `tensor.is_testaccel`) and a
process-group backend "testccl" (gloo underneath) for torch.distributed.

The build cache: $NOTEBOOK_ACCEL_CACHE_DIR/testaccel/, else
$XDG_CACHE_HOME/notebook_accel/testaccel/, else ~/.cache/notebook_accel/testaccel/, in a
folder named by torch and Python versions and a hash of the source.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import threading
from pathlib import Path

import torch

DEVICE_TYPE = "testaccel"
BACKEND = "testccl"
ENV_DEVICES = "NOTEBOOK_ACCEL_TEST_DEVICES"
ENV_DEVICE_MEMORY = "NOTEBOOK_ACCEL_TEST_DEVICE_MEMORY"
ENV_CACHE_DIR = "NOTEBOOK_ACCEL_CACHE_DIR"

SOURCE = Path(__file__).with_name("testaccel.cpp")
_LIBRARY_NAME = "testaccel_ext"
_DONE_MARKER = "built"
_lock = threading.Lock()
_loaded: Path | None = None


def cache_root() -> Path:
    """Where builds of every version live (one folder per torch, Python and source)."""
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]) / "testaccel"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "notebook_accel" / "testaccel"
    return Path.home() / ".cache" / "notebook_accel" / "testaccel"


def build_directory() -> Path:
    """This source's build folder for the running torch and Python."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return cache_root() / f"torch-{torch.__version__}-{python}-{digest}"


def library_path() -> Path:
    return build_directory() / f"{_LIBRARY_NAME}.so"


def build(verbose: bool = False) -> Path:
    """Build the extension if this source has no finished build yet, and return the
    path of its shared library. Safe to call from several processes at once: one builds
    while the others wait on a file lock, then find the build done."""
    directory = build_directory()
    library = library_path()
    if (directory / _DONE_MARKER).exists() and library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            if (directory / _DONE_MARKER).exists() and library.exists():
                return library
            # torch's own baton: a file left by a build that was killed would make
            # this one wait forever; under our lock nobody else is building.
            (directory / "lock").unlink(missing_ok=True)
            from torch.utils import cpp_extension

            cpp_extension.load(
                name=_LIBRARY_NAME,
                sources=[str(SOURCE)],
                build_directory=str(directory),
                extra_cflags=["-O2"],
                is_python_module=False,
                verbose=verbose,
            )
            (directory / _DONE_MARKER).write_text(torch.__version__ + "\n")
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)
    return library


def load() -> Path:
    """Build if needed, load the extension and register the device type (idempotent)."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
            torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        library = build()
        torch.ops.load_library(str(library))
        from . import device_module

        if not hasattr(torch, DEVICE_TYPE):
            torch._register_device_module(DEVICE_TYPE, device_module)
        if not hasattr(torch.Tensor, f"is_{DEVICE_TYPE}"):
            torch.utils.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
            )
        from . import testccl

        testccl.register()
        _loaded = library
        return library


load()

from . import device_module  # noqa: E402
from .testccl import TestCCL  # noqa: E402

__all__ = [
    "BACKEND",
    "DEVICE_TYPE",
    "ENV_CACHE_DIR",
    "ENV_DEVICES",
    "ENV_DEVICE_MEMORY",
    "TestCCL",
    "build",
    "build_directory",
    "cache_root",
    "device_module",
    "library_path",
    "load",
]
