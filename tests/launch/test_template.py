"""Workers forked from the template process (start_method="forkserver"), with real
processes: the same results, errors and output as a fork launch, one template reused
from launch to launch, replaced when it dies, and gone with the kernel."""

from __future__ import annotations

import contextlib
import linecache
import os
import signal
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
import warnings

import psutil
import pytest
import torch

from notebook_accel import WorkerError, last_run, notebook_launcher
from notebook_accel.launch import template
from notebook_accel.launch.options import ENV_START_METHOD

# Far beyond what any wait here needs: reaching it is a failure, never a hang.
WAIT_SECONDS = 30.0


@pytest.fixture(autouse=True)
def no_template_before_or_after(monkeypatch):
    """Each test starts without a template and ends its own (a child of this process)."""
    monkeypatch.delenv(ENV_START_METHOD, raising=False)
    template.shutdown_template()
    yield
    template.shutdown_template()


def launch(function, *args, start_method="forkserver", **options):
    return notebook_launcher(
        function,
        args=args,
        num_processes=2,
        backend="cpu",
        start_method=start_method,
        live=False,
        **options,
    )


# Code as a notebook cell defines it: a module named __main__ that no worker can
# import, with its source known only to linecache (as IPython registers cells).
CELL = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist


    class TinyNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.layer(x).tanh().sum()


    class CellError(ValueError):
        pass


    def train(steps):
        unseeded = torch.rand(3)  # the kernel's random state, as a forked worker has it
        dist.init_process_group("gloo")
        torch.manual_seed(0)
        model = TinyNet()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        rank = dist.get_rank()
        for step in range(steps):
            batch = torch.arange(8.0).reshape(2, 4) * (rank + 1) / (step + 1)
            model(batch).backward()
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= dist.get_world_size()
            optimizer.step()
            optimizer.zero_grad()
        return {"state": model.state_dict(), "unseeded": unseeded}


    def fail_on_rank_1():
        if os.environ["RANK"] == "1":
            raise CellError("rank 1 fails on purpose")
        return "fine"
    """
)


@pytest.fixture
def cell() -> dict:
    filename = "<notebook-cell-template-test>"
    linecache.cache[filename] = (len(CELL), None, CELL.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(CELL, filename, "exec"), namespace)  # noqa: S102 - a notebook cell stand-in
    yield namespace
    linecache.cache.pop(filename, None)


def test_cell_code_trains_bit_identically_to_a_fork_launch(cell):
    forked = launch(cell["train"], 3, start_method="fork", return_all=True)
    from_template = launch(cell["train"], 3, return_all=True)
    assert last_run().start_method == "forkserver"
    for fork_value, template_value in zip(forked, from_template, strict=True):
        assert torch.equal(fork_value["unseeded"], template_value["unseeded"])
        assert fork_value["state"].keys() == template_value["state"].keys()
        for name, tensor in fork_value["state"].items():
            assert torch.equal(tensor, template_value["state"][name]), name
    # Both ranks ended with the same weights, and training changed them.
    assert all(
        torch.equal(t, from_template[1]["state"][n]) for n, t in from_template[0]["state"].items()
    )


def test_an_exception_has_the_same_class_and_traceback_as_under_fork(cell):
    failures = {}
    for start_method in ("fork", "forkserver"):
        with pytest.raises(WorkerError) as caught:
            launch(cell["fail_on_rank_1"], start_method=start_method)
        failures[start_method] = caught.value
    forked, from_template = failures["fork"], failures["forkserver"]
    assert from_template.rank == forked.rank == 1
    assert from_template.failures[0].exception == forked.failures[0].exception
    assert forked.failures[0].exception == "CellError: rank 1 fails on purpose"
    assert from_template.traceback == forked.traceback
    assert 'raise CellError("rank 1 fails on purpose")' in from_template.traceback


def chatty():
    rank = os.environ["RANK"]
    print(f"out from {rank}")
    print(f"err from {rank}", file=sys.stderr)
    os.write(1, f"raw from {rank}\n".encode())
    return rank


def test_output_comes_back(capsys):
    assert launch(chatty) == "0"
    out, err = capsys.readouterr()
    assert "out from 0" in out.splitlines() and "[rank 1] out from 1" in out.splitlines()
    assert "raw from 0" in out.splitlines() and "[rank 1] raw from 1" in out.splitlines()
    assert "err from 0" in err.splitlines() and "[rank 1] err from 1" in err.splitlines()


def ends_rank_1(how):
    if os.environ["RANK"] == "1":
        if how == "sys.exit":
            sys.exit(3)
        if how == "os._exit":
            os._exit(5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(WAIT_SECONDS)  # stopped by the launcher once rank 1 has failed


@pytest.mark.parametrize(
    ("how", "exitcode"), [("sys.exit", 3), ("os._exit", 5), ("SIGKILL", -signal.SIGKILL)]
)
def test_exit_codes_are_the_workers_own(how, exitcode):
    with pytest.raises(WorkerError) as caught:
        launch(ends_rank_1, how)
    assert caught.value.rank == 1 and caught.value.exitcode == exitcode


def parent_pid():
    return os.getppid()


def test_the_second_launch_reuses_the_template_and_is_faster_than_its_start():
    started = time.perf_counter()
    first = launch(parent_pid)
    first_launch = time.perf_counter() - started
    status = template.template_status()
    assert first == status.pid and status.start_seconds > 0
    assert status.start_seconds < first_launch  # the first launch paid for the start
    started = time.perf_counter()
    assert launch(parent_pid) == first  # forked from the same template
    second_launch = time.perf_counter() - started
    assert second_launch < status.start_seconds
    assert template.template_status().workers == 4


def test_launches_from_threads_that_end_share_one_template_that_outlives_them():
    found = []
    threads = [threading.Thread(target=lambda: found.append(launch(parent_pid))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_SECONDS * 2)
    assert not any(thread.is_alive() for thread in threads) and len(found) == 2
    assert found[0] == found[1]  # one template served both launches
    # The thread that started it has ended; Linux's death signal did not follow it.
    assert launch(parent_pid) == found[0]


def test_a_template_killed_between_launches_is_replaced():
    first = launch(parent_pid)
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_SECONDS
    while psutil.Process(first).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the template did not die"
        time.sleep(0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error", template.TemplateWarning)  # no fallback to spawn
        second = launch(parent_pid)
    assert second != first and second == template.template_status().pid
    assert "exited" in template.template_status().replaced
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE


def where_and_what():
    return {
        "cwd": os.getcwd(),
        "value": os.environ.get("TEMPLATE_TEST_VALUE"),
        "removed": os.environ.get("TEMPLATE_TEST_REMOVED"),
        "path": sys.path[-1],
    }


def test_the_kernels_environ_cwd_and_path_of_the_moment_reach_the_workers(tmp_path, monkeypatch):
    monkeypatch.setenv("TEMPLATE_TEST_REMOVED", "present when the template started")
    before = launch(where_and_what)
    assert before["removed"] == "present when the template started"
    monkeypatch.setenv("TEMPLATE_TEST_VALUE", "set after the template started")
    monkeypatch.delenv("TEMPLATE_TEST_REMOVED")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "added")])
    after = launch(where_and_what, return_all=True)
    for value in after:
        assert value == {
            "cwd": str(tmp_path),
            "value": "set after the template started",
            "removed": None,
            "path": str(tmp_path / "added"),
        }


def test_the_template_never_initialises_cuda():
    pid = launch(parent_pid)
    seen = template.probe(["torch", "notebook_accel.launch.worker"])
    assert seen["pid"] == pid == template.template_status().pid
    assert seen["cuda_initialized"] is False and seen["device_problem"] is None
    assert seen["imported"] == {"torch": True, "notebook_accel.launch.worker": True}


def has_wave():
    return "wave" in sys.modules


def test_preload_makes_a_module_imported_in_the_next_launchs_workers():
    assert launch(has_wave, return_all=True) == [False, False]
    assert template.probe(["wave"])["imported"] == {"wave": False}
    template.preload(["wave", "__cell_module__", "torch_xla.core"])
    assert launch(has_wave, return_all=True) == [True, True]
    status = template.template_status()
    assert "wave" in status.warmed
    assert "the notebook's own code" in status.skipped["__cell_module__"]
    assert "device package" in status.skipped["torch_xla"]


def imports_wave():
    found = "wave" in sys.modules
    import wave  # noqa: F401 - what the workers report they had to import

    return found


def test_what_a_launchs_workers_imported_is_in_the_next_launchs_workers():
    assert launch(imports_wave, return_all=True) == [False, False]
    # the template imports it, never this process
    assert last_run().warming.status == "in the template" and last_run().warming.pending == []
    assert launch(imports_wave, return_all=True) == [True, True]
    assert "wave" in template.template_status().warmed


def test_a_preload_that_starts_a_device_runtime_retires_the_template(tmp_path, monkeypatch):
    (tmp_path / "sneaks_cuda.py").write_text("import torch\ntorch.cuda._initialized = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # on the template's path from its start
    first = launch(parent_pid)
    # Claimed to be installed, so that warming's filter lets it through.
    claimed = os.path.join(sysconfig.get_paths()["purelib"], "sneaks_cuda.py")
    template.preload([("sneaks_cuda", claimed)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", template.TemplateWarning)  # replaced, no fallback
        second = launch(parent_pid)
    assert second != first
    assert "importing sneaks_cuda started a device runtime" in template.template_status().replaced
    seen = template.probe(["sneaks_cuda"])
    assert seen["cuda_initialized"] is False and seen["imported"] == {"sneaks_cuda": False}


def test_a_template_that_cannot_start_means_fresh_interpreters_with_a_warning(monkeypatch):
    working = template._BOOTSTRAP
    failing = "import sys; print('no torch here', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(template, "_BOOTSTRAP", failing)
    with pytest.warns(template.TemplateWarning, match="exited with code 3") as caught:
        assert launch(parent_pid, return_all=True) == [os.getpid()] * 2  # spawned from here
    assert "no torch here" in str(caught[0].message)
    assert "exited with code 3" in template.template_status().problem
    monkeypatch.setattr(template, "_BOOTSTRAP", working)
    template.shutdown_template()  # forgets the failure: the next launch tries again
    assert launch(parent_pid) == template.template_status().pid


KERNEL_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from notebook_accel import notebook_launcher

    def record_and_wait(folder):
        written = Path(folder, "." + os.environ["RANK"])
        written.write_text(f"{os.getpid()} {os.getppid()}")
        written.rename(Path(folder, os.environ["RANK"]))  # whole once it is there
        time.sleep(600)

    if __name__ == "__main__":
        notebook_launcher(
            record_and_wait, args=(sys.argv[1],), num_processes=2, backend="cpu",
            start_method="forkserver", live=False,
        )
    """
)


def test_killing_the_kernel_leaves_no_template_nor_worker_behind(tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL_SCRIPT)
    kernel = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + WAIT_SECONDS * 2  # the template's start included
        while not all((tmp_path / rank).exists() for rank in ("0", "1")):
            assert kernel.poll() is None, "the launch ended early"
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.05)
        recorded = [(tmp_path / rank).read_text().split() for rank in ("0", "1")]
        workers = [int(pid) for pid, _ in recorded]
        template_pid = int(recorded[0][1])
        assert int(recorded[1][1]) == template_pid != kernel.pid
    finally:
        kernel.kill()
        kernel.wait(WAIT_SECONDS)
    deadline = time.monotonic() + WAIT_SECONDS
    while alive := [pid for pid in (template_pid, *workers) if _running(pid)]:
        if time.monotonic() > deadline:
            for pid in alive:  # ended before the failure: nothing runs on after the test
                with contextlib.suppress(psutil.NoSuchProcess):
                    psutil.Process(pid).kill()
            pytest.fail(f"left behind (now killed): {alive}")
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
