"""A notebook's function and arguments, by value: packed in the kernel, unpacked in a worker.

Workers in fresh interpreters (launch/fresh.py) and calls to live workers
(notebook_accel/live) get the function and its arguments this way, through
cloudpickle, so a function, class or closure defined in a notebook cell works
as it does in a forked worker. For a live worker, the functions and classes of
the notebook are bound to the worker's own namespace instead of a copy of the
kernel's globals, so that they all, helpers included, see what earlier calls
and cells left there. A tensor on a GPU in the arguments (a model the
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

# What stands, in a payload for a live worker, for the notebook's global namespace.
WORKER_NAMESPACE = "worker-namespace"


def pack(function: Any, args: tuple, kwargs: dict, live: bool = False) -> bytes:
    """A function and its arguments, pickled by value for a worker (`unpack` there).

    With `live`, for `unpack_in_namespace`: what was defined in the notebook
    will read its global names from the worker's namespace.
    """
    buffer = io.BytesIO()
    pickler = (_LivePickler if live else _WorkerPickler)(buffer, protocol=5)
    pickler.dump((function, args, kwargs))
    # The source of code that exists only in this process (a notebook cell), so
    # that a worker's traceback shows the cell's lines as a forked one's does.
    sources = {
        name: linecache.getlines(name)
        for name in sorted(pickler.code_files)
        if not os.path.exists(name) and linecache.getlines(name)
    }
    return pickle.dumps((buffer.getvalue(), sources), protocol=5)


def pack_for_cluster(function: Any, args: tuple, kwargs: dict) -> bytes:
    """`pack`, with the code of the modules beside the notebook by value too.

    A cluster's nodes have the installed packages, not the files next to the
    notebook (a helper module, a test file), which `pack` would name for the
    worker to import. Those modules are pickled by value for this call only
    (cloudpickle's registry is the process's: this runs on the launching thread).
    """
    local = _modules_beside_the_code()
    for module in local:
        cloudpickle.register_pickle_by_value(module)
    try:
        return pack(function, args, kwargs)
    finally:
        for module in local:
            cloudpickle.unregister_pickle_by_value(module)


def _modules_beside_the_code() -> list[types.ModuleType]:
    """Imported modules that are files of their own, outside the standard library and
    the installed packages (this package included: every node has it)."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    roots = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths]
    roots += site.getsitepackages() if hasattr(site, "getsitepackages") else []
    roots.append(site.getusersitepackages())
    installed = tuple(os.path.join(os.path.realpath(root), "") for root in roots if root)
    found = []
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if not origin or name in ("__main__", "__mp_main__") or name.startswith("notebook_accel"):
            continue
        if not os.path.realpath(origin).startswith(installed):
            found.append(module)
    return found


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


class _LivePickler(_WorkerPickler):
    """`_WorkerPickler` for a live worker: the globals that cloudpickle builds for the
    notebook's functions (one dict per payload, shared by every function from
    `__main__`) travel as a reference to the worker's namespace."""

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is dict and obj.get("__name__") == "__main__":
            if any(obj is built for built in self.globals_ref.values()):
                return WORKER_NAMESPACE
        return None


class _LiveUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, namespace: dict[str, Any]) -> None:
        super().__init__(file)
        self.namespace = namespace

    def persistent_load(self, pid: Any) -> Any:
        if pid != WORKER_NAMESPACE:
            raise pickle.UnpicklingError(f"unknown reference in a live call: {pid!r}")
        return self.namespace


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
    payload = _payload(shipped)
    function, args, kwargs = cloudpickle.loads(payload)
    names = getattr(function, "__globals__", None)
    if isinstance(names, dict) and names.get("__name__") == "__main__":
        main = sys.modules["__main__"].__dict__
        for name, value in names.items():
            if not name.startswith("__"):
                main.setdefault(name, value)
    return function, args, kwargs


def unpack_in_namespace(shipped: bytes, namespace: dict[str, Any]) -> tuple[Any, tuple, dict]:
    """The function, args and kwargs of a live call (`pack(..., live=True)`), with
    everything defined in the notebook reading its global names from `namespace`.

    cloudpickle writes the kernel's values of the names those functions use into
    their globals, here `namespace`. The kernel's functions and classes are its
    newest definitions and stay; any other name the worker already held keeps
    the worker's value (a model prepared on the worker wins over the kernel's
    copy of the same name). The function called is put there under its name
    too, as the notebook has it, for the worker's later cells.
    """
    held = dict(namespace)
    function, args, kwargs = _LiveUnpickler(io.BytesIO(_payload(shipped)), namespace).load()
    for name, value in held.items():
        arrived = namespace.get(name)
        if arrived is not value and not _defined_in_notebook(arrived):
            namespace[name] = value
    if _defined_in_notebook(function) and function.__qualname__.isidentifier():
        namespace[function.__qualname__] = function  # not a lambda, not nested
    return function, args, kwargs


def _defined_in_notebook(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, type)) and value.__module__ == "__main__"


def _payload(shipped: bytes) -> bytes:
    """The pickled function and arguments; the notebook code's source goes to linecache."""
    payload, sources = pickle.loads(shipped)
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return payload
