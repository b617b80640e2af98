"""A worker's prompt in a plain Python script nobody types into: bounded, and shown once.

A real script in a real process, its stdin a pipe that stays open and that nobody writes
to (a job runner, `subprocess.Popen(stdin=PIPE)`), a pipe closed at once, or a terminal
where the person ends the input. The answers a person gives (a notebook's frontend, a
terminal) are tests/launch/test_debugging.py's.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

from tests_support import PROMPTLY

ASKS_ON_RANK_ONE = """
import os
from notebook_accel import notebook_launcher

def asks():
    if os.environ["RANK"] == "1":
        breakpoint()
        try:
            return input("your name? ")
        except EOFError:
            return "no answer"
    return "rank 0"

try:
    print("result:", notebook_launcher(asks, num_processes=2, backend="cpu", timeout=10,
                                       return_all=True))
except TimeoutError:
    print("the launch timed out")
"""


def run_script(tmp_path, close_stdin: bool = False, stdin=subprocess.PIPE) -> tuple[int, str, str]:
    """Run the script with its stdin a pipe nobody writes to (closed at once, or left
    open until the script ends), or `stdin`; its exit code, stdout and stderr."""
    script = tmp_path / "asks.py"
    script.write_text(ASKS_ON_RANK_ONE)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, str(script)], stdin=stdin, stdout=stdout, stderr=stderr
        )
        try:
            if close_stdin:
                process.stdin.close()
            code = process.wait(timeout=PROMPTLY)
        finally:
            process.kill()
            process.wait()
            if process.stdin is not None and not process.stdin.closed:
                process.stdin.close()
    return code, out.read_text(), err.read_text()


@pytest.mark.timeout(PROMPTLY + 30)
def test_a_prompt_on_an_open_stdin_nobody_writes_to_keeps_the_timeout_in_force(tmp_path):
    code, out, err = run_script(tmp_path, close_stdin=False)
    assert code == 0, err
    assert "the launch timed out" in out, out + err
    # said at once: the run waits for a line on stdin, and which rank asks
    assert "rank 1 waits for a line on this process's stdin, which is not a terminal" in err


@pytest.mark.timeout(PROMPTLY + 30)
def test_with_stdin_closed_each_prompt_is_shown_once_and_the_run_goes_on(tmp_path):
    code, out, err = run_script(tmp_path, close_stdin=True)
    assert code == 0, err
    assert "result: ['rank 0', 'no answer']" in out, out + err
    assert out.count("(Pdb) ") == 1 and "[rank 1] (Pdb) \n" in out, out
    assert out.count("your name? ") == 1 and "[rank 1] your name? \n" in out, out
    assert "[debugger not opened: this process's stdin is closed; continuing]" in err


@pytest.mark.timeout(PROMPTLY + 30)
def test_at_a_terminal_ending_the_input_shows_each_prompt_once(tmp_path):
    terminal, stdin = pty.openpty()
    try:
        # the person presses Ctrl-D at each prompt (the terminal holds the presses until
        # a prompt reads them)
        os.write(terminal, b"\x04\x04")
        code, out, err = run_script(tmp_path, stdin=stdin)
    finally:
        os.close(stdin)
        os.close(terminal)
    assert code == 0, err
    assert "result: ['rank 0', 'no answer']" in out, out + err
    assert out.count("(Pdb) ") == 1 and "[rank 1] (Pdb) \n" in out, out
    assert out.count("your name? ") == 1 and "[rank 1] your name? \n" in out, out
    assert "waits for a line on this process's stdin" not in err  # a person is there
