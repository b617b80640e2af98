"""Run one of Accelerate's example scripts, as released or ported by its import lines.

`run(...)` is what each worker calls (under notebook_launcher, ours or
Accelerate's): it installs the offline stand-ins (offline_hub), loads the
script, with `accelerate` turned into `notebook_accel` in its import
statements when the target is notebook_accel and nothing else changed, sets
`sys.argv` and calls the script's `main()`, and writes what the process printed
to `<out>/rank<N>.txt`.

As a program it does the same in each process `notebook-accel launch` (or
torchrun) starts:

    notebook-accel launch --num-processes 2 tests/compat/example_run.py \\
        --target notebook_accel --out OUT SCRIPT.py -- --cpu ...
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import faulthandler
import io
import json
import os
import sys
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import offline_hub  # noqa: E402

from notebook_accel.training import ddp_teardown  # noqa: E402

HANG_REPORT_SECONDS = 120


class _Porter(ast.NodeTransformer):
    """`accelerate` -> `notebook_accel` in import statements (the one-line port), nothing else."""

    @staticmethod
    def _ported(module: str) -> str:
        if module == "accelerate" or module.startswith("accelerate."):
            return "notebook_accel" + module[len("accelerate") :]
        return module

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        if not node.level and node.module:
            node.module = self._ported(node.module)
        return node

    def visit_Import(self, node: ast.Import) -> ast.AST:
        for alias in node.names:
            ported = self._ported(alias.name)
            if ported != alias.name:
                alias.asname = alias.asname or alias.name.split(".")[0]
                alias.name = ported
        return node


def load(script: Path, target: str) -> types.ModuleType:
    """The script as a module (its `main()` not called); ported for `target="notebook_accel"`."""
    tree = ast.parse(script.read_text(), filename=str(script))
    if target == "notebook_accel":
        tree = ast.fix_missing_locations(_Porter().visit(tree))
    elif target != "accelerate":
        raise ValueError(f"target={target!r}: 'accelerate' or 'notebook_accel'")
    module = types.ModuleType(f"example_{script.stem}")
    module.__file__ = str(script)
    sys.modules[module.__name__] = module  # pickling what the script defines
    exec(compile(tree, str(script), "exec"), module.__dict__)
    return module


def run(script: str, target: str, argv: list[str], out: str, env: dict[str, str]) -> None:
    """Run `script`'s main() with `argv` in this process; its output goes to out/rank<N>.txt."""
    os.environ.update(env)
    if target == "accelerate":
        os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets
        # One thread, as `accelerate launch` gives each worker (OMP_NUM_THREADS=1) and
        # our launcher does: Accelerate's launcher forks this worker from the test
        # process, whose OpenMP threads (after an earlier test's parallel op) the fork
        # did not copy; a first parallel op with more threads waited for them forever
        # (seen in layer_norm). libgomp is not fork-safe.
        import torch

        torch.set_num_threads(1)
        # Accelerate's launcher, unlike ours, leaves a DDP model that outlives its group
        # (end_training) free to hang a rank, about one run in a hundred: its workers
        # get what ours do (notebook_accel/training/ddp_teardown.py has the stacks;
        # pytorch/pytorch#56297). Nothing the scripts print or write changes.
        ddp_teardown.hold_every_models_group_after_its_reducer()
    offline_hub.install()
    # Where a run hangs, its stacks reach the test's output.
    faulthandler.dump_traceback_later(HANG_REPORT_SECONDS, file=sys.__stderr__)
    rank = os.environ.get("RANK", "0")
    printed = io.StringIO()
    found = {"at start": _process_state(target)}
    try:
        with contextlib.redirect_stdout(printed):
            module = load(Path(script), target)
            sys.argv = [script, *argv]
            module.main()
    except BaseException:
        printed.write(traceback.format_exc())
        raise
    finally:
        faulthandler.cancel_dump_traceback_later()
        found["at end"] = _process_state(target)
        Path(out, f"rank{rank}.txt").write_text(printed.getvalue())
        Path(out, f"rank{rank}.json").write_text(json.dumps(found))


def _process_state(target: str) -> dict:
    """What decides whether this worker trains with its peers: the launcher's variables,
    a process group, and the library's process state (which a forked worker inherits),
    read without making any (making ours joins a process group)."""
    import importlib

    import torch.distributed as dist

    state = importlib.import_module(f"{target}.state").PartialState
    shared = getattr(state, "_shared_state", None) or {}
    return {
        "env": {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "process group": dist.is_available() and dist.is_initialized(),
        "num_processes": shared.get("num_processes"),
    }


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=["accelerate", "notebook_accel"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    options = parser.parse_args()
    argv = options.script_args[1:] if options.script_args[:1] == ["--"] else options.script_args
    env = dict(item.split("=", 1) for item in options.env)
    run(options.script, options.target, argv, options.out, env)


if __name__ == "__main__":
    _main()
