"""Round trip of a trivial call on 2 live CPU workers, against a raw pipe ping-pong.

    python bench/live_round_trip.py [--calls 200]

ours, cell      workers.run_cell("1"): the cell's text to every worker, the main
                rank's value back
ours, function  workers.run(fn): the function pickled by value, the same way back
raw ping-pong   the floor: 2 forked processes that echo a byte down a pipe each

Median and 90th percentile of `--calls` calls, measured in this same process.
Goal: the cell's median at most 20 ms.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import warnings

from notebook_accel.live import start_workers

WORKERS = 2


def trivial() -> int:
    return 1


def timed(call, calls: int) -> list[float]:
    for _ in range(10):  # warm up
        call()
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return samples


def echo(connection) -> None:
    while connection.recv_bytes():
        connection.send_bytes(b"1")


def raw_ping_pong(calls: int) -> list[float]:
    context = multiprocessing.get_context("fork")
    pairs = [context.Pipe() for _ in range(WORKERS)]
    processes = [context.Process(target=echo, args=(child,)) for _, child in pairs]
    for process in processes:
        process.start()

    def call() -> None:
        for parent, _ in pairs:
            parent.send_bytes(b"x")
        for parent, _ in pairs:
            parent.recv_bytes()

    try:
        return timed(call, calls)
    finally:
        for parent, _ in pairs:
            parent.send_bytes(b"")
        for process in processes:
            process.join(5)


def summary(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    calls = parser.parse_args().calls
    warnings.simplefilter("ignore")
    rows = {}
    with start_workers(WORKERS, backend="cpu", live=False) as workers:
        rows["ours, cell"] = summary(timed(lambda: workers.run_cell("1"), calls))
        rows["ours, function"] = summary(timed(lambda: workers.run(trivial), calls))
    rows["raw ping-pong"] = summary(raw_ping_pong(calls))
    floor = rows["raw ping-pong"][0]
    print(f"\n{WORKERS} live CPU workers, {calls} calls each\n")
    print("| call | median (ms) | 90th percentile (ms) | median vs raw |")
    print("|---|---|---|---|")
    for name, (median, p90) in rows.items():
        print(f"| {name} | {median * 1e3:.2f} | {p90 * 1e3:.2f} | {median / floor:.1f}x |")
    cell = rows["ours, cell"][0]
    print(f"\ncell round trip median {cell * 1e3:.2f} ms (goal: at most 20 ms)")


if __name__ == "__main__":
    main()
