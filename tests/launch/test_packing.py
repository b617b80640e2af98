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
