"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

# Importing the test accelerator's package makes it this process's accelerator for
# good: its checks run in processes of their own (tests/platforms/test_test_accelerator.py).
collect_ignore = ["testaccel"]

from notebook_accel.launch.options import ENV_START_METHOD  # noqa: E402
from notebook_accel.launch.runs.directory import ENV_RUNS_DIR, RunDirectory  # noqa: E402
from notebook_accel.launch.template import shutdown_template  # noqa: E402
from tests_support import PROMPTLY, live_children, mark_test_start  # noqa: E402

HERE = Path(__file__).parent
# The longest test files (each over a minute on 2 cores: clusters, notebooks, fresh
# environments) come first in a run in one process (TEST_WORKERS=1). `make test`'s
# pytest-xdist hands the files out by their number of tests, the most first, and keeps
# this order only among files of as many tests.
LONGEST_FIRST = [
    HERE / "torch_range",
    HERE / "launch" / "cluster",
    HERE / "notebooks" / "test_teaching_notebooks.py",
    HERE / "test_binder.py",
    HERE / "xla" / "test_xla_cpu_device.py",
    HERE / "live" / "test_live_workers.py",
]
# The files that start Ray clusters run in one process, one after another: never two
# clusters starting at once. A Ray node's raylet gives its dashboard agent a fixed 15 s to
# start (ray-project/ray#65983), and with another file's cluster starting beside it (two
# clusters' dozen Python processes importing at once on 2 cores) the teaching notebook's
# own cluster missed it twice in a row. Of the teaching notebooks, only the runs of those
# that start a cluster join them (`_starts_a_ray_cluster`): the others, minutes of work,
# are a unit of their own that another process can run meanwhile.
RAY_FILES = [HERE / "launch" / "cluster"]
RAY_SCOPE = "the files that start Ray clusters"
TEACHING_NOTEBOOKS = "tests/notebooks/test_teaching_notebooks.py"
# The files that use the documentation site's one build per run (tests/docs/conftest.py,
# `built_site`: a strict build takes about 20 s of CPU) run in one process too, or each
# process would build it again.
DOCS_SITE_FILES = [
    HERE / "docs" / "test_site_build.py",
    HERE / "docs" / "test_site_in_browser.py",
]
DOCS_SITE_SCOPE = "the files that read the documentation site's build"
# Each group of files that runs in one process under pytest-xdist, by its name.
SHARED_SCOPES = {RAY_SCOPE: RAY_FILES, DOCS_SITE_SCOPE: DOCS_SITE_FILES}


# Handed out first under pytest-xdist (make test), one to each process, ahead of their
# order by test count: the longest units of work, which started last would leave the other
# processes idle at the end: the file whose few tests each run a whole pytest on another
# torch, the Ray files, and the teaching notebooks that start no cluster.
XDIST_FIRST = ["tests/torch_range/test_torch_range.py", RAY_SCOPE, TEACHING_NOTEBOOKS]


def _within(path: Path, places: list[Path]) -> bool:
    return any(path == place or path.is_relative_to(place) for place in places)


def _starts_a_ray_cluster(root: Path, nodeid: str) -> bool:
    """Whether `nodeid` runs a teaching notebook whose code starts a Ray cluster."""
    file, _, test = nodeid.partition("::")
    run = "test_runs_top_to_bottom["
    if file != TEACHING_NOTEBOOKS or not test.startswith(run):
        return False
    name = test.removeprefix(run).removesuffix("]")
    cells = json.loads((root / "notebooks" / name).read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    return 'cluster="ray"' in code or "import ray" in code


class SuiteScheduling:
    """A pytest-xdist plugin: `--dist loadfile`, with the XDIST_FIRST files first and each
    group of SHARED_SCOPES together as one unit of work, so that one process runs it all."""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        if config.getoption("dist") != "loadfile":
            return None
        from xdist.scheduler import LoadFileScheduling

        root = config.rootpath

        class Scheduling(LoadFileScheduling):
            def _split_scope(self, nodeid: str) -> str:
                if _starts_a_ray_cluster(root, nodeid):
                    return RAY_SCOPE
                file = nodeid.split("::", 1)[0]
                for scope, files in SHARED_SCOPES.items():
                    if _within(root / file, files):
                        return scope
                return file

            def _assign_work_unit(self, node) -> None:
                for scope in reversed(XDIST_FIRST):
                    if scope in self.workqueue:
                        self.workqueue.move_to_end(scope, last=False)
                super()._assign_work_unit(node)

        return Scheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(SuiteScheduling(), "suite-scheduling")
    _own_ray_home(config)


def _own_ray_home(config: pytest.Config) -> None:
    """Ray keeps its files, and the address a plain `ray.init()` joins, under $RAY_TMPDIR
    (/tmp/ray by default). A directory of this process's own, inherited by the kernels and
    launches its tests start: the suite's clusters neither overwrite nor, on stopping,
    delete the address another Ray cluster of this machine wrote there, leave no sessions
    behind, and need no /tmp/ray (Ray's cluster_utils writes the address file without
    making its directory: FileNotFoundError on a machine that never ran Ray).
    Short, as Ray's unix socket paths under it must fit in 107 bytes."""
    home = Path(tempfile.mkdtemp(prefix="ray-home-", dir="/tmp"))
    (home / "ray").mkdir()
    os.environ["RAY_TMPDIR"] = str(home)
    config.add_cleanup(lambda: shutil.rmtree(home, ignore_errors=True))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        for index, path in enumerate(LONGEST_FIRST):
            if _within(item.path, [path]):
                return index
        return len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(params=["fork", "forkserver", "spawn"])
def each_start_method(request, monkeypatch) -> Iterator[str]:
    """Run the test three times: with forked workers, with workers forked from a
    template process (what a kernel that has touched a GPU gets), and with workers
    started in fresh interpreters. For what depends on how a worker's process starts, is
    watched, signalled and ends; a test opts in with `@EACH_START` (tests_support), a
    module with `pytestmark = pytest.mark.usefixtures("each_start_method")`."""
    monkeypatch.setenv(ENV_START_METHOD, request.param)
    yield request.param


@pytest.fixture(params=["fork", "forkserver"])
def each_way_to_ship(request, monkeypatch) -> Iterator[str]:
    """Run the test twice: with forked workers, which inherit the function, and with
    workers of start method "forkserver", which get it and its arguments by value. For
    tests of what workers do once they run: from `fresh.run_shipped` on, a worker of
    "spawn" runs the code a worker of "forkserver" runs (only how its process starts,
    is watched and ends differs, which the modules on `each_start_method` test), so a
    third run under "spawn" would repeat this one at the price of importing torch in
    every worker. A test opts in with `@SHIPPED` (tests_support), a module with
    `pytestmark = pytest.mark.usefixtures("each_way_to_ship")`."""
    monkeypatch.setenv(ENV_START_METHOD, request.param)
    yield request.param


@pytest.fixture(autouse=True, scope="module")
def template_per_module() -> Iterator[None]:
    """The template process of start method "forkserver" lasts from one launch to the
    next, as in a kernel: the tests of a module share it (starting one imports torch,
    about 2 s of CPU), and it ends with the module."""
    yield
    shutdown_template()


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every process a test started is gone when it ends; the test that left one is the
    one that fails. What ran before the test (a module's kernel or cluster, whatever an
    earlier test or another program left) is not this test's to count, nor is the
    template process in use (launch/template.py), which outlives launches on purpose;
    a template replaced and still running is."""
    before = mark_test_start()
    yield
    # Children of a finished launch are already reaped; allow a moment for
    # processes a test itself started and is shutting down (kernels, servers).
    deadline = time.monotonic() + 5
    while True:
        leftover = [child for child in live_children() if child.pid not in before]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if leftover:
        # Ended before the failure, so that the next tests do not run beside them.
        named = end_processes(leftover)
        pytest.fail(f"processes left behind (now killed): {named}")


def end_processes(processes: list[psutil.Process]) -> list[tuple[int, str]]:
    """Kill `processes` and reap those that are this process's children; their
    (pid, name), as they were before the kill."""
    named = []
    for process in processes:
        try:
            named.append((process.pid, process.name()))
        except psutil.Error:
            named.append((process.pid, "?"))
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + PROMPTLY
    while True:
        # Reaps those that are this process's children; a zombie whose parent is another
        # process has ended too.
        _, alive = psutil.wait_procs(processes, timeout=0.05)
        alive = [process for process in alive if not _zombie(process)]
        if not alive or time.monotonic() > deadline:
            break
    assert not alive, f"processes left behind that a kill did not end: {named}"
    return named


def _zombie(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


@pytest.fixture(autouse=True)
def stop_button() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a Jupyter kernel (its stop button), even
    where this process started with SIGINT ignored (a runner that started it in the
    background): tests press stop, and check that a launch leaves the handler as it was."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def kernel():
    """A real Jupyter kernel (python3) and its blocking client; shut down after the test."""
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def processes_of_runs(root: Path) -> list[psutil.Process]:
    """The keepers of the runs under `root` that still run, and everything they started."""
    found = []
    for path in root.iterdir():
        keeper = RunDirectory(path).keeper() if (path / "run.json").exists() else None
        if keeper is not None:
            try:
                process = psutil.Process(keeper.pid)
                found += [process, *process.children(recursive=True)]
            except psutil.Error:
                pass
    return found


@pytest.fixture
def runs_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """Where this test's detached runs live ($NOTEBOOK_ACCEL_RUNS_DIR; kernels started by
    the test inherit it). A keeper still running at the end fails the test, after it and
    its workers are killed."""
    root = tmp_path / "runs"
    monkeypatch.setenv(ENV_RUNS_DIR, str(root))
    yield root
    if not root.exists():
        return
    deadline = time.monotonic() + 5  # a run stopped just now is still tearing down
    while (left := processes_of_runs(root)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        named = end_processes(left)
        pytest.fail(f"processes of detached runs left (now killed): {named}")
