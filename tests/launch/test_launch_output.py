"""Worker output reaches the caller as whole lines, other ranks prefixed."""

from __future__ import annotations

import logging
import os
import sys
import time

import torch.distributed as dist

from notebook_accel import last_run, notebook_launcher
from tests_support import EACH_START, SHIPPED

# Lines are framed and parsed by the same code under every start method (SHIPPED); which
# descriptors a worker's streams get is set up as its process starts (EACH_START).


def chatty():
    rank = int(os.environ["RANK"])
    # A line written in pieces, with the other rank writing in between.
    sys.stdout.write(f"start-{rank}")
    sys.stdout.flush()
    time.sleep(0.2)
    sys.stdout.write(f"-end-{rank}\n")
    print(f"warning from {rank}", file=sys.stderr)
    os.write(1, f"raw fd line {rank}\n".encode())
    logging.getLogger("user").warning("logged by %d", rank)
    sys.stdout.write(f"no newline at exit {rank}")


@SHIPPED
def test_every_rank_prints_whole_lines_with_rank_prefixes(capsys):
    logger = logging.getLogger("user")
    handler = logging.StreamHandler(sys.stderr)  # made before the launch, as in a notebook
    logger.addHandler(handler)
    try:
        notebook_launcher(chatty, num_processes=2, backend="cpu")
    finally:
        logger.removeHandler(handler)
    out, err = capsys.readouterr()
    out_lines, err_lines = out.splitlines(), err.splitlines()
    assert "start-0-end-0" in out_lines and "[rank 1] start-1-end-1" in out_lines
    assert "raw fd line 0" in out_lines and "[rank 1] raw fd line 1" in out_lines
    assert "no newline at exit 0" in out_lines and "[rank 1] no newline at exit 1" in out_lines
    assert "warning from 0" in err_lines and "[rank 1] warning from 1" in err_lines
    assert "logged by 0" in err_lines and "[rank 1] logged by 1" in err_lines


@SHIPPED
def test_main_only_output_hides_the_other_ranks(capsys):
    notebook_launcher(chatty, num_processes=2, output="main", backend="cpu")
    out, err = capsys.readouterr()
    assert "start-0-end-0" in out.splitlines()
    assert "[rank 1]" not in out + err


def many_lines(count):
    dist.init_process_group("gloo")
    for index in range(count):
        print(f"line {index:05d} " + "x" * 100)
    return count


@SHIPPED
def test_large_output_arrives_complete_and_in_order(capsys):
    notebook_launcher(many_lines, args=(3000,), num_processes=2, backend="cpu")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("line")]
    assert lines == [f"line {index:05d} " + "x" * 100 for index in range(3000)]


def warns_between_lines(count):
    rank = int(os.environ["RANK"])
    for index in range(count):
        if index % 10 == 9:
            print(f"{rank} warning {index}", file=sys.stderr)
        else:
            print(f"{rank} line {index}")
    return sys.stdout.fileno(), sys.stderr.fileno()


@EACH_START
def test_stdout_and_stderr_lines_keep_the_order_they_were_written_in():
    # A worker writes all of this before the launcher reads any of it: with a pipe per
    # stream, the launcher's reads had put every warning after every line.
    run = notebook_launcher(
        warns_between_lines, args=(300,), num_processes=2, backend="cpu", return_all=True
    )
    assert run == [(1, 2), (1, 2)]  # what writes to the descriptors still finds them
    for rank in (0, 1):
        lines = [(line.text, line.stderr) for line in last_run().output(rank=rank)]
        assert lines == [
            (f"{rank} warning {i}", True) if i % 10 == 9 else (f"{rank} line {i}", False)
            for i in range(300)
        ]
