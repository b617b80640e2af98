"""Where this process first started CUDA, so that messages can name the culprit.

Most kernels that can no longer fork GPU workers did not mean to start CUDA:
a library did it on import (bitsandbytes, torchao; accelerate#1807, #3524),
or a cell evaluated a model on the GPU before training. `watch()` wraps
`torch.cuda._lazy_init`, the one Python function through which torch starts
CUDA, and remembers the first call that started it: the library whose code
asked for it and the notebook cell (or script line) that led there.

A kernel writes that record to a small file named after its process, so that
`notebook-accel env` run from the notebook (a child of the kernel) can show
it; `kernel_origins()` reads them back and removes those of ended processes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

from notebook_accel.internals import cuda as internal_cuda

if TYPE_CHECKING:
    import traceback

# Only os and sys at import: `import notebook_accel` imports this module and stays
# fast; what recording needs is imported when CUDA starts, once.

ENV_RUNTIME_DIR = "NOTEBOOK_ACCEL_RUNTIME_DIR"

_origin: CudaOrigin | None = None
_watching = False

# Libraries that may create a CUDA context or query the driver when imported: the
# CUDA platform's device packages, and the suspects when CUDA started before the
# watch began.
CUDA_LIBRARIES = (
    "apex",
    "bitsandbytes",
    "cuda",
    "cupy",
    "cupy_backends",
    "deepspeed",
    "flash_attn",
    "numba.cuda",
    "nvidia",
    "pycuda",
    "tensorrt",
    "torch_tensorrt",
    "torchao",
    "transformer_engine",
    "triton",
    "vllm",
    "xformers",
)


class CudaOrigin:
    """The first start of CUDA in this process, as far as it can be told.

    `library`: the package whose code asked torch for CUDA (None: the user's
    own code); `caller`: "file:line" of the frame that called into torch.cuda;
    `user_line`: the cell or script line that led there ("cell In[3], line 2:
    import bitsandbytes"); `before_watching`: CUDA was running before
    notebook_accel could watch, so only `suspects` (loaded libraries that can
    start CUDA) are known.
    """

    def __init__(
        self,
        library: str | None,
        caller: str,
        user_line: str | None,
        before_watching: bool = False,
        suspects: tuple[str, ...] = (),
    ) -> None:
        self.library = library
        self.caller = caller
        self.user_line = user_line
        self.before_watching = before_watching
        self.suspects = suspects

    def __repr__(self) -> str:
        return f"CudaOrigin({self.describe()!r})"

    def describe(self) -> str:
        """One phrase for messages: "by bitsandbytes, from cell In[3], line 2: import ..."."""
        if self.before_watching:
            text = "before notebook_accel was imported, so the line is unknown"
            if self.suspects:
                text += "; loaded libraries that can start CUDA: " + ", ".join(self.suspects)
            return text
        if self.library is None:
            return f"at {self.user_line or self.caller}"
        who = f"by {self.library} ({self.caller})"
        return f"{who}, from {self.user_line}" if self.user_line else who


def origin() -> CudaOrigin | None:
    """Where this process first started CUDA, or None if it has not (or it is unknown)."""
    return _origin


def watch() -> None:
    """Start remembering where CUDA starts in this process (once; cheap).

    Called when notebook_accel's launcher or platforms are imported (and by the
    package's import, at the first moment it can: notebook_accel/__init__.py). If torch
    is not imported yet, nothing can have started CUDA through it: the wrapper
    goes in when torch.cuda is first imported.
    """
    global _watching
    if _watching:
        return
    _watching = True
    if "torch.cuda" in sys.modules:
        _wrap(sys.modules["torch.cuda"])
    else:
        sys.meta_path.insert(0, _TorchCudaFinder())


def watched_torch_cuda_spec(name: str, path: Any, target: Any = None) -> Any:
    """The spec of torch.cuda, being imported now, whose loading ends with the watch
    in place (for a finder on sys.meta_path)."""
    global _watching
    _watching = True
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec(name, path, target)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return spec
    execute = spec.loader.exec_module

    def exec_module(module: Any) -> None:
        execute(module)
        _wrap(module)

    spec.loader.exec_module = exec_module
    return spec


def _wrap(cuda: Any) -> None:
    if cuda.is_initialized():
        _record(_before_watching())
        return
    original = internal_cuda.lazy_init(cuda)
    if getattr(original, "starts_cuda_watch", False):
        original = original.__wrapped__  # the package's import put a starter there

    def lazy_init(*args: Any, **kwargs: Any) -> Any:
        if _origin is not None or cuda.is_initialized():
            return original(*args, **kwargs)
        import traceback

        stack = traceback.extract_stack()[:-1]
        result = original(*args, **kwargs)
        if cuda.is_initialized():
            _record(_from_stack(stack))
        return result

    lazy_init.__wrapped__ = original
    internal_cuda.replace_lazy_init(cuda, lazy_init)


class _TorchCudaFinder:
    """Wraps torch.cuda right after it is first imported, then leaves sys.meta_path."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.cuda":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        return watched_torch_cuda_spec(name, path, target)


def _before_watching() -> CudaOrigin:
    loaded = tuple(name for name in CUDA_LIBRARIES if name in sys.modules)
    return CudaOrigin(None, "", None, before_watching=True, suspects=loaded)


def _from_stack(stack: traceback.StackSummary) -> CudaOrigin:
    frames = [frame for frame in stack if not _skipped(frame.filename)]
    if not frames:
        return CudaOrigin(None, "unknown", None)
    caller = frames[-1]
    library = _library_of(caller.filename)
    user = next((f for f in reversed(frames) if _library_of(f.filename) is None), None)
    return CudaOrigin(
        library=library,
        caller=f"{_short(caller.filename)}:{caller.lineno}",
        user_line=_describe_user_line(user) if user is not None else None,
    )


# The package's own directory (not this module's folder): none of its frames is the
# culprit. An Accelerator() that starts CUDA is named by the user's line that made it.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep


def _skipped(filename: str) -> bool:
    return _library_of(filename) == "torch" or os.path.realpath(filename).startswith(_OWN_DIR)


def _library_dirs() -> list[str]:
    import sysconfig

    paths = sysconfig.get_paths()
    return [
        os.path.realpath(paths[key]) + os.sep
        for key in ("purelib", "platlib", "stdlib", "platstdlib")
        if key in paths
    ]


def _library_of(filename: str) -> str | None:
    """The top-level package (or stdlib module) a file belongs to; None for user code."""
    real = os.path.realpath(filename)
    for directory in _library_dirs():
        if real.startswith(directory):
            first = real[len(directory) :].split(os.sep)[0]
            return first.removesuffix(".py")
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if marker in real:
            return real.split(marker, 1)[1].split(os.sep)[0].removesuffix(".py")
    if filename.startswith("<frozen"):
        return "python"
    return None


def _short(filename: str) -> str:
    for marker in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def _describe_user_line(frame: traceback.FrameSummary) -> str:
    import linecache

    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    cell = _cell_number(frame.filename)
    where = f"cell In[{cell}], line {frame.lineno}" if cell else f"{frame.filename}:{frame.lineno}"
    return f"{where}: {code}" if code else where


def _cell_number(filename: str) -> int | None:
    """The execution count IPython gave the cell compiled under `filename`, if any."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return None
    with contextlib.suppress(Exception):
        ip = shell.get_ipython()
        return ip.compile._filename_map.get(filename) if ip is not None else None
    return None


# -- the record, for `notebook-accel env` -----------------------------------------------


def runtime_dir() -> str:
    """Where kernels leave their records (private to this user)."""
    import tempfile

    return os.environ.get(ENV_RUNTIME_DIR) or os.path.join(
        tempfile.gettempdir(), f"notebook_accel-{os.getuid()}"
    )


def _record(found: CudaOrigin) -> None:
    global _origin
    _origin = found
    if "RANK" in os.environ:  # a launched worker starts CUDA on purpose
        return
    with contextlib.suppress(Exception):  # only a report depends on it
        import json

        import psutil

        directory = runtime_dir()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        record = {
            "pid": os.getpid(),
            "started": psutil.Process().create_time(),
            "command": " ".join(psutil.Process().cmdline()[:3]),
            "origin": found.describe(),
        }
        path = os.path.join(directory, f"cuda-origin-{os.getpid()}.json")
        with open(path + ".tmp", "w") as file:
            json.dump(record, file)
        os.replace(path + ".tmp", path)


def kernel_origins() -> list[dict[str, Any]]:
    """The records of processes still running that started CUDA; stale ones are removed."""
    import json

    import psutil

    found = []
    directory = runtime_dir()
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(directory)):
            if not (name.startswith("cuda-origin-") and name.endswith(".json")):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path) as file:
                    record = json.load(file)
                alive = psutil.Process(record["pid"]).create_time() == record["started"]
            except (OSError, ValueError, KeyError, psutil.Error):
                alive = False
            if alive:
                found.append(record)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
    return found


def forget() -> None:
    """Drop this process's record (tests)."""
    global _origin
    _origin = None
    with contextlib.suppress(OSError):
        os.remove(os.path.join(runtime_dir(), f"cuda-origin-{os.getpid()}.json"))
