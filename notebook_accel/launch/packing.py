"""A notebook's function and arguments, by value: packed in the kernel, unpacked in a worker.

Workers in fresh interpreters (launch/fresh.py) and calls to live workers
(notebook_accel/live) get the function and its arguments this way, through
cloudpickle, so a function, class or closure defined in a notebook cell works
as it does in a forked worker. A tensor on a GPU in the arguments (a model the
kernel loaded and evaluated) arrives on the GPU of each worker that runs on
CUDA, and on the CPU in a CPU worker: never on whichever GPU the kernel used.
"""

from __future__ import annotations

import io
import linecache
import marshal
import os
import pickle
import sys
import types
from typing import Any

import cloudpickle

from notebook_accel.config.settings import ENV_BACKEND


def pack(function: Any, args: tuple, kwargs: dict) -> bytes:
    """A function and its arguments, pickled by value for a worker (`unpack` there)."""
    buffer = io.BytesIO()
    pickler = _WorkerPickler(buffer, protocol=5)
    pickler.dump((function, args, kwargs))
    # The source of code that exists only in this process (a notebook cell), so
    # that a worker's traceback shows the cell's lines as a forked one's does.
    sources = {
        name: linecache.getlines(name)
        for name in sorted(pickler.code_files)
        if not os.path.exists(name) and linecache.getlines(name)
    }
    return pickle.dumps((buffer.getvalue(), sources), protocol=5)


class _WorkerPickler(cloudpickle.Pickler):
    """cloudpickle, with two changes for workers:

    - Code keeps its file name and line numbers (marshalled whole; the worker
      runs the same interpreter), where cloudpickle would name it
      "<dynamic-code>": tracebacks then point at the notebook cell.
    - Tensors on a GPU go as CPU copies that each worker moves to its own
      device (plain pickling would restore them onto the GPU index the kernel
      used, which a worker may not have).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.code_files: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            self.code_files.add(obj.co_filename)
            return marshal.loads, (marshal.dumps(obj),)
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            is_parameter = isinstance(obj, torch.nn.Parameter)
            return _on_worker_device, (obj.detach().cpu(), is_parameter, obj.requires_grad)
        return super().reducer_override(obj)


def _on_worker_device(tensor: Any, is_parameter: bool, requires_grad: bool) -> Any:
    """Runs in the worker: put a tensor that was on a GPU in the kernel on this worker's device."""
    import torch

    if os.environ.get(ENV_BACKEND) == "cuda":
        tensor = tensor.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def unpack(shipped: bytes) -> tuple[Any, tuple, dict]:
    """The user's function, args and kwargs, in the worker.

    What the function's cell defined (classes, helpers) is also put in this
    interpreter's `__main__`, as it is in the kernel's: a value of a class
    from the notebook is then sent back by reference and arrives in the
    kernel as an instance of the kernel's own class.
    """
    payload, sources = pickle.loads(shipped)
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    function, args, kwargs = cloudpickle.loads(payload)
    names = getattr(function, "__globals__", None)
    if isinstance(names, dict) and names.get("__name__") == "__main__":
        main = sys.modules["__main__"].__dict__
        for name, value in names.items():
            if not name.startswith("__"):
                main.setdefault(name, value)
    return function, args, kwargs
