"""A worker's input(), breakpoint() and post-mortem debugger, answered where the launch runs.

Real 2-worker gloo runs under every start method, or the two ways to ship (below); the
user at the prompt is played by `input()` in this process (what a kernel turns into
Jupyter's stdin request and a script reads from its terminal). The same in a real
Jupyter kernel:
tests/notebooks/test_debugging_in_kernel.py.
"""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest
import torch

from notebook_accel import Accelerator, WorkerError, notebook_launcher
from notebook_accel.launch import debugging, supervisor
from tests_support import EACH_START, PROMPTLY, SHIPPED

# Prompts are answered by code a worker runs once it is started (SHIPPED); how a worker
# reads PYTHONBREAKPOINT, and what a stop does to workers at a prompt or beside a
# post-mortem, depend on how its process started (EACH_START).
pytestmark = pytest.mark.timeout(90)


class User:
    """Plays the user at the prompts: records each prompt, gives the next answer (a
    line, an exception to raise, or a function to call for it)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.prompts: list[str] = []
        self.answer = None  # or a function of the prompt, for answers that depend on it

    def __call__(self, prompt: str = "") -> str:
        self.prompts.append(prompt)
        if self.answer is not None:
            return self.answer(prompt)
        if not self.answers:
            raise EOFError
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer() if callable(answer) else answer


@pytest.fixture
def user(monkeypatch):
    def play(*answers) -> User:
        player = User(*answers)
        # Where the launch asks (not builtins.input: a forked worker would inherit that).
        monkeypatch.setattr(debugging, "input", player, raising=False)
        return player

    return play


def stops_on_rank_one():
    accelerator = Accelerator()
    secret = torch.tensor([1.0, 2.0]) * (accelerator.process_index + 1)
    if accelerator.process_index == 1:
        breakpoint()
        secret = secret * 10  # a debugger command can change what comes next
    return accelerator.gather(secret).tolist()


@SHIPPED
def test_breakpoint_in_a_worker_opens_pdb_in_the_cell_and_continuing_lets_the_run_go_on(
    user, capfd
):
    player = user("p secret", "secret = secret + 1", "c")
    result = notebook_launcher(stops_on_rank_one, num_processes=2, backend="cpu", timeout=60)
    # the peer waited in its collective while rank 1 was at its prompt
    assert result == [1.0, 2.0, 30.0, 50.0]
    assert player.prompts == ["[rank 1] (Pdb) "] * 3
    out = capfd.readouterr().out
    assert "[rank 1] > " in out and "test_debugging.py(" in out and "stops_on_rank_one()" in out
    assert "[rank 1] tensor([2., 4.])\n" in out
    # pdb's stack starts at the user's code: the worker's frames are left out
    assert "worker.py" not in out


def each_rank_asks():
    accelerator = Accelerator()
    name = input(f"rank {accelerator.process_index}, your name? ")
    breakpoint()
    return name


def answer_by_prompt(prompt: str) -> str:
    """The user reads each prompt before answering it: the ranks reach their prompts in
    any order (rank 0 may be at its debugger before rank 1 has asked its name)."""
    if prompt.endswith("(Pdb) "):
        return "c"
    return {"[rank 0] rank 0, your name? ": "ada", "[rank 1] rank 1, your name? ": "grace"}[prompt]


@SHIPPED
def test_every_rank_s_prompt_says_which_rank_and_input_in_a_worker_is_answered(user):
    player = user()
    player.answer = answer_by_prompt
    names = notebook_launcher(
        each_rank_asks, num_processes=2, backend="cpu", timeout=60, return_all=True
    )
    assert names == ["ada", "grace"]
    assert sorted(player.prompts) == [
        "[rank 0] (Pdb) ",
        "[rank 0] rank 0, your name? ",
        "[rank 1] (Pdb) ",
        "[rank 1] rank 1, your name? ",
    ]
    # each rank asks its name before it reaches its own breakpoint
    for rank in (0, 1):
        mine = [prompt for prompt in player.prompts if prompt.startswith(f"[rank {rank}]")]
        assert mine == [f"[rank {rank}] rank {rank}, your name? ", f"[rank {rank}] (Pdb) "]


@SHIPPED
def test_where_nobody_can_answer_a_breakpoint_is_passed_and_input_raises_eof(user, capfd):
    user()  # the frontend has no stdin: every prompt gets EOFError
    result = notebook_launcher(stops_on_rank_one, num_processes=2, backend="cpu", timeout=60)
    assert result == [1.0, 2.0, 20.0, 40.0]
    assert "[debugger not opened: this process's stdin is closed; continuing]" in (
        capfd.readouterr().err
    )
    with pytest.raises(WorkerError) as raised:
        notebook_launcher(each_rank_asks, num_processes=2, backend="cpu", timeout=60)
    assert "EOFError" in str(raised.value)


@SHIPPED
def test_a_launch_from_another_thread_passes_breakpoints_and_says_why(user, capfd):
    player = user("c")
    results: list[object] = []

    def launch() -> None:
        try:
            results.append(
                notebook_launcher(
                    stops_on_rank_one, num_processes=2, backend="cpu", timeout=PROMPTLY
                )
            )
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            results.append(error)

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join(PROMPTLY + 20)  # past the launch's timeout, which ends it and its workers
    assert not thread.is_alive(), "the launch on another thread did not return"
    assert results == [[1.0, 2.0, 20.0, 40.0]]
    assert player.prompts == []
    assert "the launch runs on a thread other than the notebook's main one" in (
        capfd.readouterr().err
    )


@EACH_START
def test_pythonbreakpoint_0_turns_breakpoints_off(user, monkeypatch):
    monkeypatch.setenv("PYTHONBREAKPOINT", "0")
    player = user("c")
    result = notebook_launcher(stops_on_rank_one, num_processes=2, backend="cpu", timeout=60)
    assert result == [1.0, 2.0, 20.0, 40.0]
    assert player.prompts == []


class LaunchClock:
    """The launching process's clock (the supervisor's `time`), which the test can move
    forward as if a person had sat at a prompt that long: no wall-clock race, however
    busy the machine (a fresh interpreter alone can take seconds there)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead

    def __getattr__(self, name: str):
        return getattr(time, name)


@SHIPPED
def test_time_at_a_prompt_does_not_count_towards_the_timeout(user, monkeypatch):
    from notebook_accel.launch import supervisor

    clock = LaunchClock()
    monkeypatch.setattr(supervisor, "time", clock)

    def an_hour_at_the_prompt() -> str:
        clock.ahead += 3600
        return "c"

    user(an_hour_at_the_prompt)
    result = notebook_launcher(stops_on_rank_one, num_processes=2, backend="cpu", timeout=60)
    assert result == [1.0, 2.0, 20.0, 40.0]


@EACH_START
def test_stop_pressed_at_a_prompt_stops_the_run(user):
    user(KeyboardInterrupt())
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        notebook_launcher(stops_on_rank_one, num_processes=2, backend="cpu", timeout=600)
    assert time.monotonic() - started < PROMPTLY  # not the launch's timeout


def fails_deep_inside(limit):
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        steps = [0.5, 0.25]
        return _step(steps, limit)
    accelerator.wait_for_everyone()  # waits for rank 1, which never comes
    return "rank 0 never gets here"


def _step(steps, limit):
    window = steps[:limit]
    return steps[limit] / len(window)


def groups_started(monkeypatch) -> list[supervisor.WorkerGroup]:
    """The worker groups the launches start from now on, each once it has started."""
    groups: list[supervisor.WorkerGroup] = []
    start = supervisor.WorkerGroup.start

    def recorded(group: supervisor.WorkerGroup) -> None:
        start(group)
        groups.append(group)

    monkeypatch.setattr(supervisor.WorkerGroup, "start", recorded)
    return groups


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@EACH_START
def test_post_mortem_opens_pdb_on_the_failed_rank_s_frames_and_the_others_are_stopped(
    user, capfd, monkeypatch
):
    groups = groups_started(monkeypatch)

    def after_rank_0_has_ended():  # the user reads until rank 0's stop has landed
        rank_0 = next(w for w in groups[0].workers if w.rank == 0).process.pid
        deadline = time.monotonic() + PROMPTLY
        while not ended(rank_0):
            assert time.monotonic() < deadline, "rank 0 was not stopped"
            time.sleep(0.01)
        return "p window"

    player = user(after_rank_0_has_ended, "up", "p steps", "p limit * 10", "c")
    with pytest.raises(WorkerError) as raised:
        notebook_launcher(
            fails_deep_inside, args=(2,), num_processes=2, backend="cpu", timeout=60,
            post_mortem=True,
        )  # fmt: skip
    assert player.prompts == ["[rank 1] (Pdb) "] * 5
    out = capfd.readouterr().out
    assert "rank 1 raised IndexError: list index out of range: post-mortem debugger" in out
    assert "_step()\n[rank 1] -> return steps[limit] / len(window)" in out
    assert "[rank 1] [0.5, 0.25]\n" in out  # window, then steps one frame up
    assert "[rank 1] 20\n" in out
    error = raised.value
    # the failed rank's error comes first; the one stopped meanwhile is a consequence
    assert error.rank == 1 and "IndexError" in str(error).splitlines()[0]
    assert "rank 0 was killed by SIGTERM (most likely a consequence)" in str(error)


def rank_0_is_slow_to_stop():
    accelerator = Accelerator()
    if accelerator.process_index == 0:
        # A rank that does not end at once when stopped (busy in C code, a loaded
        # machine): its collective fails when rank 1 ends, after rank 1's debugger.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    accelerator.wait_for_everyone()
    if accelerator.process_index == 1:
        raise KeyError("no such column")
    torch.distributed.all_reduce(torch.ones(1))


@SHIPPED
def test_a_peer_failing_after_the_first_failure_opens_no_second_debugger(user, capfd):
    player = user("c", "c")
    with pytest.raises(WorkerError) as raised:
        notebook_launcher(
            rank_0_is_slow_to_stop, num_processes=2, backend="cpu", timeout=PROMPTLY,
            post_mortem=True,
        )  # fmt: skip
    assert player.prompts == ["[rank 1] (Pdb) "]
    assert raised.value.rank == 1 and "KeyError" in str(raised.value).splitlines()[0]
    err = capfd.readouterr().err
    assert "[debugger not opened: the run is ending: rank 1 failed first; continuing]" in err


@SHIPPED
def test_without_post_mortem_a_failure_asks_nothing(user):
    player = user("c")
    with pytest.raises(WorkerError):
        notebook_launcher(fails_deep_inside, args=(2,), num_processes=2, backend="cpu", timeout=60)
    assert player.prompts == []
