"""A worker's Python streams share one pipe in frames; the launcher reads them back as
lines of each stream, in the order they were written."""

from __future__ import annotations

import os
import select
import sys

import pytest

from notebook_accel import last_run, notebook_launcher
from notebook_accel.launch.output_pipes import (
    MAX_FRAME_PAYLOAD,
    FramedLines,
    StreamLines,
    python_streams,
)


@pytest.fixture
def pipe():
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    yield read_end, write_end
    os.close(read_end)
    os.close(write_end)


def read_everything(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunks.append(os.read(fd, 1 << 16))
        except BlockingIOError:
            return b"".join(chunks)


def test_lines_of_both_streams_come_back_in_the_order_written(pipe):
    read_end, write_end = pipe
    stdout, stderr = python_streams(write_end)
    stdout.write("half of a line, ")
    print("a warning", file=stderr)
    print("the other half", file=stdout)
    print("résumé ✓", file=stdout)  # several bytes a character
    assert FramedLines().feed(read_everything(read_end)) == [
        ("stderr", "a warning\n"),
        ("stdout", "half of a line, the other half\n"),
        ("stdout", "résumé ✓\n"),
    ]


def test_a_write_longer_than_a_frame_goes_in_atomic_frames(pipe):
    read_end, write_end = pipe
    stdout, _ = python_streams(write_end)
    line = "x" * (3 * MAX_FRAME_PAYLOAD + 5) + "\n"
    stdout.write(line)
    data = read_everything(read_end)
    # 3 full frames and a short one, each no longer than a pipe writes at once
    assert len(data) == len(line) + 4 * 3
    assert all(len(frame) <= select.PIPE_BUF for frame in _frames(data))
    assert FramedLines().feed(data) == [("stdout", line)]


def _frames(data: bytes) -> list[bytes]:
    frames = []
    while data:
        length = int.from_bytes(data[1:3], "little")
        frames.append(data[: 3 + length])
        data = data[3 + length :]
    return frames


def test_frames_split_anywhere_between_reads_are_joined(pipe):
    read_end, write_end = pipe
    stdout, stderr = python_streams(write_end)
    for index in range(20):
        print(f"out {index}", file=stdout)
        print(f"err {index}", file=stderr)
    data = read_everything(read_end)
    lines = FramedLines()
    got = [pair for offset in range(len(data)) for pair in lines.feed(data[offset : offset + 1])]
    assert got == [
        pair
        for index in range(20)
        for pair in (("stdout", f"out {index}\n"), ("stderr", f"err {index}\n"))
    ]


def test_the_streams_keep_the_descriptors_below_them(pipe):
    _, write_end = pipe
    stdout, stderr = python_streams(write_end)
    assert (stdout.fileno(), stderr.fileno()) == (1, 2)
    assert not stdout.isatty()


def test_a_prompt_is_stdout_s_partial_line_and_the_rest_is_flushed(pipe):
    read_end, write_end = pipe
    stdout, stderr = python_streams(write_end)
    stdout.write("Your name? ")
    stderr.write("no newline on stderr")
    lines = FramedLines()
    assert lines.feed(read_everything(read_end)) == []
    assert lines.take_partial("stdout") == "Your name? "
    assert lines.flush() == [("stderr", "no newline on stderr\n")]
    assert lines.flush() == []


def test_a_descriptor_s_lines_are_of_its_stream():
    lines = StreamLines("stderr")
    assert lines.feed(b"one\ntw") == [("stderr", "one\n")]
    assert lines.take_partial("stdout") == ""
    assert lines.flush() == [("stderr", "tw\n")]


# One start method: the worker's side is the same code in every one; what each passes
# the pipe through is tested in test_launch_output.py.
def writes_with_a_forked_child(count):
    # A process the worker forks (a DataLoader's worker) shares its Python streams.
    child = os.fork()
    who = "child" if child == 0 else "parent"
    for index in range(count):
        sys.stdout.write(f"{who} {index:04d} " + who[0] * 1000 + "\n")
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)


def test_a_process_the_worker_forks_writes_whole_lines_beside_it():
    notebook_launcher(
        writes_with_a_forked_child, args=(300,), num_processes=2, backend="cpu", output="main"
    )
    for rank in (0, 1):
        lines = [line.text for line in last_run().output(rank=rank)]
        for who in ("parent", "child"):
            mine = [line for line in lines if line.startswith(who)]
            assert mine == [f"{who} {i:04d} " + who[0] * 1000 for i in range(300)]
        assert len(lines) == 600
