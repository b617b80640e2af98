"""Each end of the tested torch range (notebook_accel/internals/tested_range.py), in an environment
that holds that torch and what `pip install notebook_accel` brings, nothing more
(tests/torch_range/range_env.py builds it once, outside the checkout):

- the environment is bare: every package in it is torch, a declared dependency, or
  something one of those requires (so an undeclared one fails the base features);
- the base features a user runs first work there (bare_scenario.py: save_state and
  load_state with exact resume, the demo, live workers, a launch from a real kernel);
- the compatibility subset of this suite passes there, on that torch: launches with
  fork, forkserver and spawn, the Accelerator (prepare, backward, accumulate, gather,
  mixed precision), checkpoints and exact resume at 1 to 4 processes, FSDP2, the
  ParallelismConfig layouts, live workers, a notebook in a real kernel, and every
  guard of a private torch API (tests/test_torch_internals.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import range_env  # noqa: E402
import venv_cache  # noqa: E402

# Each torch builds its environment once (minutes, several GB) and then runs the subset.
pytestmark = pytest.mark.timeout(1500)

SUBSET = [
    "tests/test_torch_internals.py",
    "tests/launch/test_fresh_start.py",
    "tests/live/test_live_workers.py::test_calls_reach_every_worker_and_return_real_objects",
    "tests/live/test_ddp_private_api.py",
    "tests/accelerator/test_single_process.py",
    "tests/accelerator/test_two_workers.py",
    "tests/accelerator/test_public_api_two_workers.py",
    "tests/checkpoint/test_resume_world_sizes.py",
    "tests/training/test_ddp_teardown.py",
    "tests/training/fsdp/test_fsdp_training.py",
    "tests/training/fsdp/test_fsdp_checkpoint.py",
    "tests/training/test_parallelism.py",
    "tests/training/test_parallelism_mesh.py",
    "tests/notebooks/test_launch_in_kernel.py",
]
# What the base environment may hold besides the declared closure: what venv puts there.
SEEDED = {"pip", "setuptools"}


@pytest.fixture(scope="module", params=range_env.versions(), ids=lambda v: f"torch{v}")
def torch_env(request) -> tuple[str, Path]:
    version = request.param
    try:
        return version, range_env.ensure(version)
    except (subprocess.CalledProcessError, SystemExit) as error:
        if not venv_cache.pip_finds("torch", version):
            pytest.skip(
                f"the torch {version} environment cannot be built: pip finds no torch "
                f"{version} with its configuration ({error}); run "
                "`python tests/torch_range/range_env.py` where its package index is reachable"
            )
        raise


def clean_environment(*paths: Path) -> dict[str, str]:
    """This process's variables without the suite's own (pytest-xdist's, the launcher's
    settings), with `paths` alone on PYTHONPATH."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("PYTEST_", "NOTEBOOK_ACCEL_"))
        and name not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(str(path) for path in paths)
    return env


_INSTALLED = """
import importlib.metadata as md, json
print(json.dumps({d.metadata["Name"]: d.requires or [] for d in md.distributions()}))
"""


def declared_closure(installed: dict[str, list[str]], roots: list[str]) -> set[str]:
    """The distributions `roots` (requirements) need, following each one's requirements
    with their extras and markers, among those `installed` (name -> its requirements)."""
    requires = {canonicalize_name(name): reqs for name, reqs in installed.items()}
    needed: set[str] = set()
    pending = [(Requirement(root), frozenset()) for root in roots]
    seen = set()
    while pending:
        requirement, _ = pending.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen or name not in requires:
            continue
        seen.add(key)
        needed.add(name)
        for text in requires[name]:
            child = Requirement(text)
            extras = requirement.extras or {""}
            if child.marker is None or any(child.marker.evaluate({"extra": e}) for e in extras):
                pending.append((child, frozenset()))
    return needed


def test_the_environment_holds_only_what_the_package_declares(torch_env):
    version, python = torch_env
    installed = json.loads(venv_cache.run(python, _INSTALLED, clean_environment()))
    roots = [f"torch=={version}", *venv_cache.small_deps()]
    extra = {canonicalize_name(name) for name in installed} - declared_closure(installed, roots)
    assert extra - SEEDED == set(), "installed without being declared by anything"
    assert "torch" in declared_closure(installed, roots)
    assert venv_cache.checkout_pointer(python) == ""  # no notebook_accel of any checkout
    bare = subprocess.run(
        [str(python), "-c", "import pytest"], capture_output=True, env=clean_environment(), cwd="/"
    )
    assert bare.returncode != 0  # the test tools are beside it, not in it


def test_base_features_in_the_bare_environment(torch_env, tmp_path):
    version, python = torch_env
    done = subprocess.run(
        [str(python), str(HERE / "bare_scenario.py")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=clean_environment(REPO),
    )
    lines = done.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[7:])
    print("\n".join(line for line in lines if line.startswith(("OK ", "RESULT "))))
    assert result["torch"].split("+")[0] == version
    assert result["steps"] == dict.fromkeys(result["steps"], "ok"), done.stdout[-4000:]
    assert set(result["steps"]) == {"exact_resume", "demo", "live_workers", "kernel_launch"}
    assert done.returncode == 0


def test_the_compatibility_subset_passes(torch_env, tmp_path):
    version, python = torch_env
    done = subprocess.run(
        [
            str(python), "-m", "pytest", *SUBSET,
            "-p", "no:cacheprovider", "-q", f"--basetemp={tmp_path / 'pytest'}",
            f"--junitxml={tmp_path / 'junit.xml'}",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
        env=clean_environment(REPO, REPO / "tests", range_env.tools_dir(version)),
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(f"torch {version}: {summary}")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    counts = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|failed|error)", summary))
    assert counts.get("passed", 0) >= 80 and "failed" not in counts, summary
