"""A notebook's function and arguments, by value: packed in the kernel, unpacked in a worker.

Workers in fresh interpreters (launch/fresh.py), calls to live workers
(notebook_accel/live) and workers on a cluster get the function and its arguments
this way, through cloudpickle, so a function, class or closure defined in a notebook
cell works as it does in a forked worker.
"""

from __future__ import annotations

import hashlib
import io
import linecache
import marshal
import os
import pickle
import sys
import types
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import cloudpickle

from notebook_accel.config.settings import ENV_BACKEND

# What stands, in a payload for a live worker, for the notebook's global namespace.
WORKER_NAMESPACE = "worker-namespace"


def pack(
    function: Any,
    args: tuple,
    kwargs: dict,
    live: bool = False,
    sent: SentValues | None = None,
) -> bytes:
    """A function and its arguments, pickled by value for a worker (`unpack` there).

    With `live`, for `unpack_in_namespace`: what was defined in the notebook
    will read its global names from the worker's namespace; `sent` (the live
    group's record of what earlier calls sent) says which of the notebook's
    values the kernel has changed since, which then replace the workers'.
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
    changed = sent.changed(pickler.notebook_values()) if live and sent is not None else []
    return pickle.dumps((buffer.getvalue(), sources, changed), protocol=5)


class SentValues:
    """What the notebook's global values were when a live group last received them.

    A name counts as changed when the kernel bound it to another value since (a
    cell that set `lr = 1e-4` again), or changed a container's contents; a model
    trained, or a tensor changed, in place is the same object and not changed.
    """

    def __init__(self) -> None:
        self._records: dict[str, tuple[str, Any]] = {}

    def changed(self, values: dict[str, Any]) -> list[str]:
        """The names of `values` not sent before or changed since; records them as sent."""
        changed = []
        for name, value in values.items():
            record = self._records.get(name)
            if record is None or not _still(record, value):
                changed.append(name)
            self._records[name] = _record(value)
        return changed


_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _record(value: Any) -> tuple[str, Any]:
    """How to tell later whether `value` is still the kernel's value (holding no large
    object alive): plain values by value, others by identity, containers by content."""
    if isinstance(value, _PLAIN) or (
        isinstance(value, tuple) and all(isinstance(item, _PLAIN) for item in value)
    ):
        return "value", value
    try:
        return "object", weakref.ref(value)
    except TypeError:  # a dict, a list: no weak reference; compared by what it holds
        pass
    try:
        return "content", hashlib.sha1(cloudpickle.dumps(value)).hexdigest()
    except Exception:  # noqa: BLE001 - cannot be pickled: it was not sent either
        return "id", id(value)


def _still(record: tuple[str, Any], value: Any) -> bool:
    kind, seen = record
    if kind == "value":
        return type(seen) is type(value) and (seen is value or seen == value)
    if kind == "object":
        return seen() is value
    return _record(value) == record


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
    found = []
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if not origin or name in ("__main__", "__mp_main__") or name.startswith("notebook_accel"):
            continue
        if not os.path.realpath(origin).startswith(installed_roots()):
            found.append(module)
    return found


@lru_cache(maxsize=1)
def installed_roots() -> tuple[str, ...]:
    """The directories of the standard library, of installed packages and of notebook_accel,
    each as given and resolved, ending in a separator: code under them is on every machine."""
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    roots = [paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths]
    roots += [*site.getsitepackages(), site.getusersitepackages()]
    roots.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    real = (os.path.abspath, os.path.realpath)
    return tuple(sorted({os.path.join(path(r), "") for r in roots if r for path in real}))


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
        torch = sys.modules.get("torch")  # no tensor to ship unless torch is imported
        if torch and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            is_parameter = isinstance(obj, torch.nn.Parameter)
            shipped = obj.detach().cpu()
            return _on_worker_device, (shipped, is_parameter, obj.requires_grad, obj.device.type)
        return super().reducer_override(obj)


class _LivePickler(_WorkerPickler):
    """`_WorkerPickler` for a live worker: the globals that cloudpickle builds for the
    notebook's functions (one dict per payload, shared by every function from
    `__main__`) travel as a reference to the worker's namespace."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._notebook_values: dict[str, Any] = {}  # global name -> the kernel's value

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is dict and obj.get("__name__") == "__main__":
            if any(obj is built for built in self.globals_ref.values()):
                return WORKER_NAMESPACE
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.FunctionType) and obj.__globals__.get("__name__") == "__main__":
            for name in _global_names(obj.__code__):  # what cloudpickle sends of them
                if name in obj.__globals__ and not name.startswith("__"):
                    self._notebook_values[name] = obj.__globals__[name]
        return super().reducer_override(obj)

    def notebook_values(self) -> dict[str, Any]:
        """The notebook's global values the pickled functions use (not functions or
        classes of the notebook: the kernel's newest always replace the workers')."""
        return {
            name: value
            for name, value in self._notebook_values.items()
            if not _defined_in_notebook(value) and not isinstance(value, types.ModuleType)
        }


def _global_names(code: types.CodeType) -> set[str]:
    """The names `code` and the code nested in it (comprehensions, inner functions) look
    up, global ones among them."""
    nested = (_global_names(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return set(code.co_names).union(*nested)


def _on_worker_device(
    tensor: Any, is_parameter: bool, requires_grad: bool, device_type: str = "cuda"
) -> Any:
    """Runs in the worker: put a tensor that was on a device in the kernel on this
    worker's device of that type (on the CPU where the worker runs elsewhere)."""
    import torch

    if os.environ.get(ENV_BACKEND) == device_type:
        from notebook_accel.platforms.registry import platform_named

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        tensor = tensor.to(platform_named(device_type).device(local_rank))
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
    payload, _ = _payload(shipped)
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
    their globals, here `namespace`. Which value a name keeps there:

    - the notebook's functions and classes: the kernel's (its newest definitions);
    - a name the kernel sent before and has changed since (`SentValues`): the
      kernel's new value, unless the worker bound the name to a value of its own
      (then the worker's stays);
    - any other name the worker holds: the worker's (a model prepared or trained
      on the worker wins over the kernel's copy of the same name).

    The function called is put there under its name too, as the notebook has it,
    for the worker's later cells.
    """
    held = dict(namespace)
    payload, changed = _payload(shipped)

    def persistent_load(pid: Any) -> Any:
        if pid != WORKER_NAMESPACE:
            raise pickle.UnpicklingError(f"unknown reference in a live call: {pid!r}")
        return namespace

    unpickler = pickle.Unpickler(io.BytesIO(payload))
    unpickler.persistent_load = persistent_load
    function, args, kwargs = unpickler.load()
    # namespace (by id: one per worker process, alive as long as it) -> its names' values
    # as they came from the kernel
    from_kernel = _kernel_values.setdefault(id(namespace), {})
    for name, value in held.items():
        arrived = namespace.get(name)
        if arrived is value or _defined_in_notebook(arrived):
            continue
        if name in changed and name in from_kernel and from_kernel[name]() is value:
            continue  # the kernel changed it, and the worker had not: the kernel's
        namespace[name] = value
    for name, value in namespace.items():
        if name not in held or held[name] is not value:
            from_kernel[name] = _held(value)
    if _defined_in_notebook(function) and function.__qualname__.isidentifier():
        namespace[function.__qualname__] = function  # not a lambda, not nested
    return function, args, kwargs


def _held(value: Any) -> Callable[[], Any]:
    """A value a live worker took from the kernel, which the call returns (weakly where it
    can: a name the worker rebinds must not keep the old value alive)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


_kernel_values: dict[int, dict[str, Callable[[], Any]]] = {}


def _defined_in_notebook(value: Any) -> bool:
    return isinstance(value, (types.FunctionType, type)) and value.__module__ == "__main__"


def _payload(shipped: bytes) -> tuple[bytes, list[str]]:
    """The pickled function and arguments, and the names the kernel changed since its last
    live call; the notebook code's source goes to linecache."""
    payload, sources, changed = pickle.loads(shipped)
    for name, lines in sources.items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
    return payload, changed
