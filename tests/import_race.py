"""Import notebook_accel from many threads at the same moment, in fresh processes.

    python tests/import_race.py ROUNDS THREADS

What a kernel does when a background thread (a widget's, a tracker's) and a cell
import the package or its modules at once. The other libraries the package's modules
import are imported first, in this process (the race is about the package's own
import locks; those libraries take most of the time); then each round forks a child that has
not imported notebook_accel, whose THREADS threads each import one of its modules
(the package itself among them) once a barrier lets them all go. Prints one JSON
line: the rounds run and every error a thread met.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "notebook_accel"


def module_names() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def importable_alone(names: list[str]) -> tuple[list[str], list[str]]:
    """The modules a child imports one after another without error (those that need an
    optional library this install lacks are left out of the race), and the other
    modules that importing them loaded."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read)
        before = set(sys.modules)
        good = []
        for name in names:
            try:
                __import__(name)
            except ImportError:
                continue
            good.append(name)
        others = [
            name for name in set(sys.modules) - before if not name.startswith("notebook_accel")
        ]
        os.write(write, json.dumps([good, sorted(others)]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        good, others = json.loads(pipe.read())
    os.waitpid(child, 0)
    return good, others


def race(names: list[str], threads: int) -> list[str]:
    """In this (forked) process: `threads` threads import names round-robin at once."""
    barrier = threading.Barrier(threads)
    errors: list[str] = []

    def importer(name: str) -> None:
        barrier.wait()
        try:
            __import__(name)
        except BaseException:  # noqa: BLE001 - every error is the finding
            errors.append(f"{name}: {traceback.format_exc(limit=-3)}")

    # The package itself and the modules a cell imports first lead the list.
    chosen = ["notebook_accel", *names]
    workers = [
        threading.Thread(target=importer, args=(chosen[i % len(chosen)],), daemon=True)
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        if worker.is_alive():
            errors.append(f"{worker.name} still importing after 120 s")
    return errors


def main(rounds: int, threads: int) -> None:
    names, others = importable_alone(module_names())
    for name in others:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module that only imports as part of another
            pass
    failures: list[str] = []
    for round_number in range(rounds):
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read)
            # Each round races over a different order of the modules.
            shift = round_number * 7 % len(names)
            errors = race(names[shift:] + names[:shift], threads)
            os.write(write, json.dumps(errors).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            text = pipe.read()
        _, status = os.waitpid(child, 0)
        errors = json.loads(text) if text else [f"child ended with status {status}"]
        failures += [f"round {round_number}: {error}" for error in errors]
    print(json.dumps({"rounds": rounds, "modules": len(names), "errors": failures}))


if __name__ == "__main__":
    sys.path.insert(0, str(PACKAGE.parent))
    main(int(sys.argv[1]), int(sys.argv[2]))
