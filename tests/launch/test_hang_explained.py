"""A run that makes no progress is explained in the cell: each rank's collective and line.

Real 2-worker gloo runs for the classic hangs (a rank skips a collective and blocks on a
lock, ranks call collectives in another order, one rank has one more batch, with an
explicit collective and with DDP's own gradient all-reduce), a rank inside a library's
import, Stop pressed on a stuck run, a busy run that is never reported; and the parsing
of faulthandler's dumps.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from notebook_accel import Accelerator, notebook_launcher
from notebook_accel.launch.options import HANG_AFTER_SECONDS, OPTIONS
from notebook_accel.launch.stacks import DDP_ALL_REDUCE, Frame, StackCapture, collective_of, explain
from notebook_accel.launch.supervisor import STUCK_ON_STOP_SECONDS
from notebook_accel.reporting.events import AttemptStarted, RanksStuck, ResourceSample
from tests_support import PROMPTLY, press_stop

HERE = os.path.basename(__file__)


def different_order():
    rank = Accelerator().process_index
    x, y = torch.ones(3), torch.ones(3)
    if rank == 0:
        dist.all_reduce(x)
        dist.broadcast(y, 0)
    else:
        dist.broadcast(y, 0)
        dist.all_reduce(x)


def one_more_batch():
    accelerator = Accelerator()
    for _ in range(3 if accelerator.process_index == 0 else 2):
        dist.all_reduce(torch.ones(4))
    accelerator.wait_for_everyone()


def blocked_on_a_lock():
    rank = Accelerator().process_index
    print("stuck from here", flush=True)  # the workers' last progress
    lock = threading.Lock()
    lock.acquire()
    if rank == 1:
        lock.acquire()  # never given back: rank 1 never reaches the all_reduce
    dist.all_reduce(torch.ones(2))


# A stuck run ends at its timeout (PROMPTLY) only where it never gets to be stopped.
STUCK_RUN = pytest.mark.timeout(PROMPTLY * 2)


class StopWhenStuck:
    """Presses stop once the run has gone on for `after_explanation` seconds after showing
    where each rank is or, without it, once it has made no progress for `stalled` seconds
    since the workers' last output or event. The launcher counts each such event as
    progress when it takes it in, before this observer hears of it (memory samples and the
    explanation are none), so it has waited at least as long. Looks at each memory sample
    (one a second while workers run)."""

    def __init__(self, stalled: float = 0.0, after_explanation: float | None = None) -> None:
        self.stalled, self.after_explanation = stalled, after_explanation
        self.last_progress: float | None = None
        self.explained_at: float | None = None
        self.pressed = False

    def on_event(self, event, report) -> None:
        now = time.monotonic()
        if isinstance(event, RanksStuck):
            self.explained_at = self.explained_at or now
        elif isinstance(event, ResourceSample):
            if not self.pressed and self._due(now):
                self.pressed = True
                press_stop()
        elif not isinstance(event, AttemptStarted):  # the launcher's, before the workers start
            self.last_progress = now

    def _due(self, now: float) -> bool:
        if self.after_explanation is not None:
            shown = self.explained_at
            return shown is not None and now - shown > self.after_explanation
        return self.last_progress is not None and now - self.last_progress > self.stalled


def _stuck_run(function, capfd, stop: StopWhenStuck | None = None, **options) -> tuple[type, str]:
    """Run `function` until it is stuck and stopped: by default pressed once the hang was
    explained (after 1.5 s) and the run went on for longer than that without explaining
    it again. The timeout only ends a run that never gets there."""
    hang_after = options.setdefault("explain_hang_after", 1.5)
    stop = stop or StopWhenStuck(after_explanation=hang_after)
    options = {"timeout": PROMPTLY, "num_processes": 2, **options}
    with pytest.raises((TimeoutError, KeyboardInterrupt)) as raised:
        notebook_launcher(function, backend="cpu", observers=[stop], **options)
    assert stop.pressed, "never stuck long enough to be stopped"
    return raised.type, capfd.readouterr().err


DETAIL_HINT = "TORCH_DISTRIBUTED_DEBUG=DETAIL"


@STUCK_RUN
@pytest.mark.parametrize(
    ("function", "expected", "hint"),
    [
        (
            different_order,
            [
                "rank 0: waits in torch.distributed.all_reduce, called from different_order",
                "rank 1: waits in torch.distributed.broadcast, called from different_order",
                "The ranks wait in different collectives (rank 0 in all_reduce; rank 1 in "
                "broadcast): they call collectives in a different order",
            ],
            True,  # torch would name the mismatch at once
        ),
        (
            one_more_batch,
            [
                "rank 0: waits in torch.distributed.all_reduce, called from one_more_batch",
                "rank 1: waits in torch.distributed.barrier, called from one_more_batch",
                "or one calls one more (a longer loop, an extra batch)",
            ],
            True,
        ),
        (
            blocked_on_a_lock,
            [
                "rank 0: waits in torch.distributed.all_reduce, called from blocked_on_a_lock",
                "rank 1: not in a collective, at blocked_on_a_lock",
                "Rank 0 wait(s) in all_reduce for rank 1.",
            ],
            False,  # the report names the rank that keeps the others waiting; torch could not
        ),
    ],
)
def test_a_stalled_run_shows_where_each_rank_is_and_goes_on(function, expected, hint, capfd):
    kind, err = _stuck_run(function, capfd)
    assert kind is KeyboardInterrupt  # shown, then the run went on until stopped
    assert err.count("no progress for 1.5 s") == 1  # once per stall
    for line in expected:
        assert line in err, err
    # each rank's stack, innermost first, the cell's (here the test file's) lines marked,
    # the launcher's own frames left out; faulthandler's raw dump not echoed as output
    assert "rank 0's stack, innermost first:\n" in err
    assert f"-> {__file__}" in err
    assert "worker_main" not in err and "(most recent call first)" not in err
    assert (DETAIL_HINT in err) is hint


def ddp_one_more_step():
    accelerator = Accelerator()
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(3 if accelerator.process_index == 0 else 2):
        print(f"step {step}", flush=True)  # progress: the stall starts at the last step
        loss = model(torch.ones(2, 4)).sum()
        accelerator.backward(loss)  # DDP's reducer all-reduces the gradients in here
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()


@STUCK_RUN
def test_a_rank_in_ddp_s_gradient_all_reduce_is_in_a_collective(capfd):
    # rank 0's loader has one more batch: its backward waits in the all-reduce DDP's
    # reducer launches from autograd (no Python frame of torch.distributed), rank 1 in
    # the barrier after the loop. The forked workers inherit torch._dynamo, which the
    # first optimizer step would otherwise import for seconds: a stall of its own.
    import torch._dynamo  # noqa: F401

    kind, err = _stuck_run(ddp_one_more_step, capfd)
    assert kind is KeyboardInterrupt
    for line in [
        "rank 0: waits in DistributedDataParallel's gradient all-reduce (inside backward), "
        "called from ddp_one_more_step",
        "rank 1: waits in torch.distributed.barrier, called from ddp_one_more_step",
        "The ranks wait in different collectives (rank 0 in DistributedDataParallel's gradient "
        "all-reduce; rank 1 in barrier): they call collectives in a different order, or one "
        "calls one more (a longer loop, an extra batch).",
    ]:
        assert line in err, err
    assert "not in a collective" not in err
    assert DETAIL_HINT in err


SLOW_LIBRARY = """\
import threading

threading.Event().wait()  # an import that takes longer than explain_hang_after
"""


def imports_a_library(folder):
    sys.path.insert(0, folder)
    print("importing", flush=True)
    import slow_library  # noqa: F401  (the line the report names)


@STUCK_RUN
def test_a_rank_inside_a_library_s_import_is_at_the_import_line(tmp_path, capfd):
    # an installed package's module, as torch._dynamo imported by a first optimizer.step()
    packages = tmp_path / "lib" / "python3" / "site-packages"
    packages.mkdir(parents=True)
    (packages / "slow_library.py").write_text(SLOW_LIBRARY)
    kind, err = _stuck_run(imports_a_library, capfd, args=(str(packages),))
    assert kind is KeyboardInterrupt
    line = _line_of("import slow_library")
    for rank in (0, 1):
        assert (
            f"rank {rank}: not in a collective: importing {packages / 'slow_library.py'}, "
            f"called from imports_a_library ({__file__}, line {line})"
        ) in err, err
    assert f"  -> {__file__}, line {line}, in imports_a_library" in err
    # Python's import machinery is no code of the user's
    assert "<frozen importlib._bootstrap>" in err and "-> <frozen" not in err
    assert DETAIL_HINT not in err  # no rank is in a collective: torch has nothing to check


def _line_of(text: str) -> int:
    with open(__file__) as source:
        return next(
            n for n, line in enumerate(source, 1) if text in line and "_line_of" not in line
        )


def one_rank_skips_an_all_reduce():
    accelerator = Accelerator()
    if accelerator.process_index != 2:  # rank 2 skips it and goes on to the next one
        dist.all_reduce(torch.ones(2))
    accelerator.wait_for_everyone()


@STUCK_RUN
def test_on_three_workers_the_rank_that_skipped_a_collective_is_named(capfd):
    kind, err = _stuck_run(one_rank_skips_an_all_reduce, capfd, num_processes=3)
    assert kind is KeyboardInterrupt
    for line in [
        "rank 0: waits in torch.distributed.all_reduce, called from one_rank_skips_an_all_reduce",
        "rank 1: waits in torch.distributed.all_reduce, called from one_rank_skips_an_all_reduce",
        "rank 2: waits in torch.distributed.barrier, called from one_rank_skips_an_all_reduce",
        "they call collectives in a different order, or one calls one more",
    ]:
        assert line in err, err


@STUCK_RUN
def test_stop_pressed_on_a_stuck_run_shows_where_it_was(capfd):
    # what the notebook's Stop button does: SIGINT to the kernel, here once the run has
    # made no progress for longer than the launcher waits before it explains a stop
    stop = StopWhenStuck(stalled=STUCK_ON_STOP_SECONDS + 1)
    kind, err = _stuck_run(blocked_on_a_lock, capfd, stop, explain_hang_after=None)
    assert kind is KeyboardInterrupt
    # how long, to the second, depends on when the press lands: a loaded machine delays it
    assert re.search(
        r"Stop pressed after \d+ s without progress; before the workers are stopped", err
    )
    assert "rank 1: not in a collective, at blocked_on_a_lock" in err
    assert "no progress for" not in err  # explain_hang_after=None: not before the Stop


def busy():
    for step in range(25):  # 3.75 s of steps, a step every 0.15 s
        print(f"step {step}", flush=True)
        time.sleep(0.15)
    return "done"


@pytest.mark.timeout(60)
def test_a_run_that_makes_progress_is_never_reported(capfd):
    # Longer than explain_hang_after in all, each step far shorter, however loaded the machine
    done = notebook_launcher(busy, num_processes=2, backend="cpu", explain_hang_after=2.5)
    assert done == "done"
    assert "Where each rank is" not in capfd.readouterr().err


def test_the_option_has_a_default_and_refuses_nonsense():
    option = OPTIONS["explain_hang_after"]
    assert option.default == HANG_AFTER_SECONDS == 120.0
    assert option.check(None) is None and option.check(30) == 30.0
    for bad in (0, -1, "soon", True):
        with pytest.raises(ValueError, match="explain_hang_after=.* must be a positive number"):
            option.check(bad)


DUMP = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/x/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/tmp/ipykernel_1/123.py", line 5 in train
  File "/x/notebook_accel/platforms/base.py", line 179 in run_in_worker
  File "/x/notebook_accel/launch/worker.py", line 249 in _call_user_function
  File "/x/notebook_accel/launch/worker.py", line 163 in worker_main
  File "/tmp/ipykernel_1/999.py", line 1 in <module>
"""


def test_a_dump_is_read_out_of_the_worker_s_stderr_and_nothing_else():
    capture = StackCapture()
    assert not capture.take("Thread 0x1 (most recent call first):\n")  # not asked for
    capture.expect()
    taken = [capture.take(line) for line in DUMP.splitlines(keepends=True)]
    assert all(taken)
    assert not capture.take("the user's own line\n")
    frames = capture.finish()  # the worker's thread, without the launcher's frames
    assert [f.function for f in frames] == ["all_reduce", "wrapper", "train", "run_in_worker"]
    text = explain("stuck", {0: frames}, {1: "finished (exited with code 0)"})
    assert "rank 0: waits in torch.distributed.all_reduce, called from train" in text
    assert "rank 1: finished (exited with code 0)" in text
    assert "Rank 0 wait(s) in all_reduce for rank 1." in text
    assert "  -> /tmp/ipykernel_1/123.py, line 5, in train" in text
    assert explain("stuck", {0: []}, {}).count("did not answer") == 1
    assert Frame("/x/notebook_accel/launch/worker.py", 1, "f").in_libraries


def _frames(*specs: tuple[str, int, str]) -> list[Frame]:
    return [Frame(*spec) for spec in specs]


CELL = ("/tmp/ipykernel_1/123.py", 7, "train")
ENGINE = ("/x/site-packages/torch/autograd/graph.py", 979, "_engine_run_backward")
BACKWARD = ("/x/site-packages/torch/_tensor.py", 623, "backward")
BARRIER = ("/x/site-packages/torch/distributed/distributed_c10d.py", 5356, "barrier")


def test_a_backward_is_ddp_s_all_reduce_only_where_the_worker_said_its_model_syncs():
    in_backward = _frames(ENGINE, BACKWARD, CELL)
    stacks = {0: in_backward, 1: _frames(BARRIER, CELL)}
    said = explain("stuck", stacks, {}, all_reducing=[0])
    assert "rank 0: waits in DistributedDataParallel's gradient all-reduce (inside backward)" in (
        said
    )
    assert "they call collectives in a different order, or one calls one more" in said
    # no DDP model that syncs (none at all, or under no_sync): a backward that is slow
    alone = explain("stuck", stacks, {})
    assert "rank 0: not in a collective: in _engine_run_backward" in alone
    assert "Rank 1 wait(s) in barrier for rank 0." in alone
    # a collective with a Python frame is that collective, whatever the note said
    assert "rank 1: waits in torch.distributed.barrier" in explain(
        "stuck", stacks, {}, all_reducing=[0, 1]
    )


def test_torch_s_detail_check_is_suggested_only_where_collectives_may_not_match():
    waits = _frames(BARRIER, CELL)
    blocked = _frames(("/usr/lib/python3.11/threading.py", 320, "wait"), CELL)
    all_in_one = explain("stuck", {0: waits, 1: waits}, {})
    one_elsewhere = explain("stuck", {0: waits, 1: blocked}, {})
    none_in_one = explain("stuck", {0: blocked, 1: blocked}, {})
    one_finished = explain("stuck", {0: waits}, {1: "finished (exited with code 0)"})
    assert DETAIL_HINT in all_in_one  # its sizes may differ between the ranks
    for text in (one_elsewhere, none_in_one, one_finished):
        assert DETAIL_HINT not in text, text


def test_python_s_import_machinery_is_not_the_user_s_code():
    frames = _frames(
        ("/x/site-packages/torch/_dynamo/eval_frame.py", 40, "<module>"),
        ("<frozen importlib._bootstrap>", 241, "_call_with_frames_removed"),
        ("/x/site-packages/torch/_dynamo/__init__.py", 3, "<module>"),
        ("<frozen importlib._bootstrap>", 241, "_call_with_frames_removed"),
        ("<frozen importlib._bootstrap>", 1176, "_find_and_load"),
        ("/x/site-packages/torch/optim/optimizer.py", 500, "step"),
        CELL,
    )
    assert Frame("<frozen importlib._bootstrap>", 241, "f").in_libraries
    text = explain("stuck", {0: frames}, {})
    assert (
        "rank 0: not in a collective: importing /x/site-packages/torch/_dynamo/__init__.py, "
        "called from train (/tmp/ipykernel_1/123.py, line 7)"
    ) in text
    assert "-> <frozen" not in text and "  -> /tmp/ipykernel_1/123.py, line 7, in train" in text


def test_a_thread_inside_a_backward_shows_autograd_s_engine_as_its_innermost_frame():
    # what a rank in DDP's gradient all-reduce is recognised by, on the running torch: a
    # hook runs inside the engine, so its caller is the engine's Python frame
    seen = []
    tensor = torch.ones(2, requires_grad=True)
    tensor.register_hook(lambda grad: seen.append(sys._getframe(1).f_code))
    (tensor * 2).sum().backward()
    assert collective_of([Frame(seen[0].co_filename, 1, seen[0].co_name)], True) == (DDP_ALL_REDUCE)
    assert collective_of([Frame(seen[0].co_filename, 1, seen[0].co_name)]) is None
