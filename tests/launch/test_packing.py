"""Functions from the notebook, by value: for a live worker they read the worker's names."""

from __future__ import annotations

import sys
import types

from notebook_accel.launch import packing

NOTEBOOK = """
weights = [0, 0]  # the kernel's copy
factor = 3

def scaled():
    return [w * factor for w in weights]

def total():
    return sum(scaled())
"""


def notebook(source: str = NOTEBOOK) -> dict:
    """The globals of a notebook's cells: functions whose module is `__main__`."""
    names = {"__name__": "__main__"}
    exec(source, names)  # noqa: S102 - a test's own cell
    return names


def test_a_helper_of_the_called_function_reads_the_workers_names():
    worker = {"__name__": "__main__", "weights": [1, 1]}
    function, args, kwargs = packing.unpack_in_namespace(
        packing.pack(notebook()["total"], (), {}, live=True), worker
    )
    assert function() == 6  # the worker's weights, the kernel's factor
    assert worker["weights"] == [1, 1] and worker["factor"] == 3
    assert worker["total"] is function and worker["scaled"].__globals__ is worker


def test_an_edited_definition_replaces_the_one_an_earlier_call_left():
    worker = {"__name__": "__main__", "weights": [1, 1]}
    packing.unpack_in_namespace(packing.pack(notebook()["total"], (), {}, live=True), worker)
    edited = notebook(NOTEBOOK + "\ndef scaled():\n    return [w * factor * 10 for w in weights]\n")
    function, _, _ = packing.unpack_in_namespace(
        packing.pack(edited["total"], (), {}, live=True), worker
    )
    assert function() == 60


def test_a_global_written_by_a_helper_lands_in_the_workers_names():
    cell = notebook("def remember(value):\n    global kept\n    kept = value\n")
    worker = {"__name__": "__main__"}
    function, args, _ = packing.unpack_in_namespace(
        packing.pack(cell["remember"], (5,), {}, live=True), worker
    )
    function(*args)
    assert worker["kept"] == 5


def test_a_launch_payload_keeps_its_own_globals(monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a fresh worker's
    function, _, _ = packing.unpack(packing.pack(notebook()["total"], (), {}))
    assert function() == 0  # a fresh worker has no names of its own: the kernel's copy


def _call(worker: dict, cells: dict, sent: packing.SentValues, name: str = "read"):
    payload = packing.pack(cells[name], (), {}, live=True, sent=sent)
    function, _, _ = packing.unpack_in_namespace(payload, worker)
    return function()


def test_a_value_the_kernel_changed_is_sent_again_unless_the_worker_set_its_own():
    kernel = notebook(
        "lr = 0.1\nconfig = {'depth': 2}\ndef read():\n    return lr, config['depth']\n"
    )
    worker, sent = {"__name__": "__main__"}, packing.SentValues()
    assert _call(worker, kernel, sent) == (0.1, 2)
    exec("lr = 0.001\nconfig['depth'] = 3", kernel)  # noqa: S102 - the user's next cell
    assert _call(worker, kernel, sent) == (0.001, 3)  # rebound, and changed in place
    worker["lr"] = 5.0  # a worker cell sets its own
    exec("lr = 0.5", kernel)  # noqa: S102
    assert _call(worker, kernel, sent) == (5.0, 3)
    assert _call(worker, kernel, sent) == (5.0, 3)  # and keeps it


def test_an_object_trained_in_place_on_the_worker_is_not_replaced_by_the_kernel_s_copy():
    import torch

    kernel = notebook("def read():\n    return float(model.weight.detach().sum())\n")
    kernel["model"] = torch.nn.Linear(2, 1, bias=False)
    worker, sent = {"__name__": "__main__"}, packing.SentValues()
    _call(worker, kernel, sent)
    with torch.no_grad():
        worker["model"].weight.fill_(7.0)  # trained on the worker, the same object
    assert _call(worker, kernel, sent) == 14.0
    kernel["model"] = torch.nn.Linear(2, 1, bias=False)  # a cell makes a new one
    with torch.no_grad():
        kernel["model"].weight.fill_(1.0)
    assert _call(worker, kernel, sent) == 2.0  # the kernel's new model: it changed


def test_what_counts_as_changed_in_the_kernel():
    class Thing:
        pass

    sent = packing.SentValues()
    tensor, items = Thing(), [1, 2]
    first = {"n": 3, "ratio": 0.5, "name": "a", "shape": (2, 3), "obj": tensor, "items": items}
    assert sorted(sent.changed(first)) == sorted(first)
    assert sent.changed(dict(first)) == []  # nothing rebound, nothing changed
    items.append(3)
    assert sent.changed({**first, "ratio": 0.5 + 0.0, "n": 4}) == ["n", "items"]
    assert sent.changed({**first, "n": 4, "obj": Thing()}) == ["obj"]
