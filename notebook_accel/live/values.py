"""What a call sends back: its value, or what a notebook would show for it.

A value travels pickled. Some cannot: a generator or a lambda cannot be
pickled on the worker, and a prepared DDP model (it needs a process group)
or an instance of a class defined only on the workers cannot be unpickled
in the kernel. Such a value stays on the worker, and the call returns a
`ValueOnWorker`: the repr the worker made of it, shown the way IPython shows
an Out value, marked as coming from the worker. The group goes on either way.

The repr is made on the worker only for a value that is not plain data
(numbers, strings, tensors and containers of them), which the kernel can
always read: a call that returns a tensor pays nothing for it.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

# A repr longer than this is cut (a model with thousands of layers).
REPR_CHARS = 20_000
# Containers with more items than this are not inspected item by item.
PLAIN_ITEMS = 1_000


@dataclass(frozen=True)
class ValueOnWorker:
    """A value that could not come back from worker `rank`: its repr there and why.

    The value itself stays on the worker, in the cell's namespace if it was
    given a name there.
    """

    rank: int
    type_name: str  # "torch.nn.parallel.distributed.DistributedDataParallel"
    text: str  # the value's repr on the worker
    reason: str  # "it cannot be pickled (TypeError: cannot pickle 'generator' object)"

    def __repr__(self) -> str:
        marker = f"# repr on worker rank {self.rank}; the value stays there: {self.reason}"
        return f"{marker}\n{self.text}"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


@dataclass(frozen=True)
class PackedValue:
    """A call's value as it travels back: pickled, and its repr when the kernel may need it."""

    data: bytes | None  # None: it could not be pickled
    type_name: str
    text: str | None = None
    reason: str = ""


def pack(value: Any) -> PackedValue:
    """On the worker: `value` pickled, with its repr unless it is plain data."""
    type_name = _type_name(value)
    text = None if _plain(value) else _repr(value)
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 - any failure to pickle leaves the value there
        text = text if text is not None else _repr(value)
        return PackedValue(None, type_name, text, f"it cannot be pickled ({_one_line(error)})")
    return PackedValue(data, type_name, text)


def unpack(packed: Any, rank: int) -> Any:
    """In the kernel: the value itself, or a ValueOnWorker when it cannot be read here."""
    if not isinstance(packed, PackedValue):
        return packed  # not sent by pack() (None from a rank whose value was not asked for)
    if packed.data is not None:
        try:
            return pickle.loads(packed.data)
        except Exception as error:  # noqa: BLE001 - e.g. a class only the workers have
            reason = f"the kernel cannot unpickle it ({_one_line(error)})"
            return ValueOnWorker(rank, packed.type_name, packed.text or _no_repr(packed), reason)
    return ValueOnWorker(rank, packed.type_name, packed.text or _no_repr(packed), packed.reason)


def _plain(value: Any, budget: list[int] | None = None) -> bool:
    """Whether the kernel surely reads `value`: builtin data, tensors, containers of them."""
    import torch

    budget = budget if budget is not None else [PLAIN_ITEMS]
    budget[0] -= 1
    if budget[0] < 0:
        return False
    kind = type(value)
    if value is None or kind in (bool, int, float, complex, str, bytes):
        return True
    if kind in (torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype, torch.device):
        return True
    if kind in (list, tuple, set, frozenset):
        return all(_plain(item, budget) for item in value)
    if kind is dict:
        return all(_plain(k, budget) and _plain(v, budget) for k, v in value.items())
    return False


def _repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as error:  # noqa: BLE001 - a broken __repr__ must not lose the call
        return f"<{_type_name(value)} object (its repr raised {_one_line(error)})>"
    if len(text) > REPR_CHARS:
        text = text[:REPR_CHARS] + f"... ({len(text) - REPR_CHARS} more characters)"
    return text


def _type_name(value: Any) -> str:
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def _no_repr(packed: PackedValue) -> str:
    return f"<{packed.type_name} object>"


def _one_line(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
