"""Where a process first started CUDA: the culprit a launch and `notebook-accel env` name.

torch here may have no CUDA, so a stand-in for the torch.cuda module starts
"CUDA" when its _lazy_init is called, from a file laid out as an installed
library would be.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from notebook_accel.cli import environment_report
from notebook_accel.platforms import cuda_origin


class FakeCuda:
    """What cuda_origin wraps: is_initialized() and _lazy_init()."""

    def __init__(self) -> None:
        self.started = False

    def is_initialized(self) -> bool:
        return self.started

    def _lazy_init(self) -> None:
        self.started = True


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(cuda_origin.ENV_RUNTIME_DIR, str(tmp_path / "runtime"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(cuda_origin, "_origin", None)
    yield tmp_path / "runtime"
    cuda_origin.forget()


@pytest.fixture
def fake_library(tmp_path, monkeypatch):
    """A package `gpulib` in a site-packages folder whose import starts "CUDA"."""
    site = tmp_path / "site-packages" / "gpulib"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(
        "from notebook_accel.platforms.cuda_origin import _origin\n"
        "def setup(cuda):\n"
        "    cuda._lazy_init()  # what a library does on import\n"
    )
    monkeypatch.syspath_prepend(str(site.parent))
    yield importlib.import_module("gpulib")
    sys.modules.pop("gpulib", None)


def start_from_user_code(library, cuda):
    library.setup(cuda)  # the user's line


def test_the_library_and_the_user_line_that_started_cuda_are_named(runtime_dir, fake_library):
    cuda = FakeCuda()
    cuda_origin._wrap(cuda)
    start_from_user_code(fake_library, cuda)
    found = cuda_origin.origin()
    assert found.library == "gpulib"
    assert found.caller.startswith(os.path.join("gpulib", "__init__.py") + ":3")
    assert found.user_line.endswith("library.setup(cuda)  # the user's line")
    assert found.describe().startswith("by gpulib (gpulib")
    cuda._lazy_init()  # later calls change nothing
    assert cuda_origin.origin() is found


def test_the_users_own_code_is_named_as_such(runtime_dir):
    cuda = FakeCuda()
    cuda_origin._wrap(cuda)
    cuda._lazy_init()
    found = cuda_origin.origin()
    assert found.library is None
    assert found.describe().startswith(f"at {__file__}:")
    assert "cuda._lazy_init()" in found.describe()


def test_cuda_started_before_watching_names_the_loaded_suspects(runtime_dir, monkeypatch):
    cuda = FakeCuda()
    cuda.started = True
    monkeypatch.setitem(sys.modules, "bitsandbytes", sys)
    cuda_origin._wrap(cuda)
    text = cuda_origin.origin().describe()
    assert "before notebook_accel was imported" in text
    assert "bitsandbytes" in text


def test_the_record_reaches_notebook_accel_env_and_goes_with_its_process(runtime_dir):
    cuda = FakeCuda()
    cuda_origin._wrap(cuda)
    cuda._lazy_init()
    report = environment_report()
    assert f"pid {os.getpid()} (" in report
    assert cuda_origin.origin().describe() in report
    # The command, run from this process as `!notebook-accel env` would be, shows it too.
    shown = subprocess.run(
        [sys.executable, "-m", "notebook_accel.cli", "env"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert cuda_origin.origin().describe() in shown
    # A record left by a process that has ended is removed when read.
    (runtime_dir / "cuda-origin-999999999.json").write_text(
        '{"pid": 999999999, "started": 1.0, "command": "x", "origin": "gone"}'
    )
    assert [r["pid"] for r in cuda_origin.kernel_origins()] == [os.getpid()]
    assert not (runtime_dir / "cuda-origin-999999999.json").exists()


def test_a_launched_worker_leaves_no_record(runtime_dir, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    cuda = FakeCuda()
    cuda_origin._wrap(cuda)
    cuda._lazy_init()
    assert cuda_origin.origin() is not None
    assert not runtime_dir.exists()


def test_watching_starts_when_torch_cuda_is_first_imported():
    code = (
        "import sys, notebook_accel\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "print(getattr(torch.cuda._lazy_init, '__wrapped__', None) is not None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "True"


def test_the_users_line_is_named_when_the_package_itself_started_cuda(runtime_dir):
    """An `Accelerator()` in a cell starts CUDA from the package's own code (the device
    of training/state.py): the culprit is the cell's line, not a line of the package."""
    import traceback

    import notebook_accel.training.state as state

    user = traceback.FrameSummary(__file__, 7, "train", line="accelerator = Accelerator()")
    package = traceback.FrameSummary(state.__file__, 90, "from_environment", line="device = ...")
    found = cuda_origin._from_stack(traceback.StackSummary.from_list([user, package]))
    assert found.library is None
    assert found.describe() == f"at {__file__}:7: accelerator = Accelerator()"


def test_watching_starts_at_the_first_start_when_torch_came_before_the_package(runtime_dir):
    """`import torch` then `import notebook_accel`: the package imports none of its modules
    when imported (notebook_accel/_lazy.py), yet the first start of CUDA is named."""
    code = (
        "import sys, torch\n"
        "started = []\n"
        "torch.cuda.is_initialized = lambda: bool(started)\n"  # this machine may have no GPU
        "torch.cuda._lazy_init = lambda: started.append(1)\n"
        "import notebook_accel\n"
        "assert 'notebook_accel.platforms.cuda_origin' not in sys.modules\n"
        "def cell():\n"
        "    torch.cuda._lazy_init()\n"
        "cell()\n"
        "from notebook_accel.platforms import cuda_origin\n"
        "print(cuda_origin.origin().describe())\n"
    )
    env = {**os.environ, cuda_origin.ENV_RUNTIME_DIR: str(runtime_dir)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "at <string>:8", done.stdout
