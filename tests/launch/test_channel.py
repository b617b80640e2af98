"""The channel's framing alone: events written by a worker come back whole and in order;
and the end of a channel the worker left, however it left it."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from notebook_accel.launch.channel import ChannelReader, ChannelWriter, frame
from notebook_accel.launch.debugging import Answer
from notebook_accel.launch.supervisor import read_some, write_before
from notebook_accel.reporting.events import (
    MetricRecord,
    PeakResources,
    Progress,
    Result,
    Unreadable,
    WorkerRaised,
)


def _fail_on_load():
    raise RuntimeError("no such class here")


class OnlyInTheWorker:
    """Pickles fine; unpickling fails, as a class only the worker has would."""

    def __reduce__(self):
        return (_fail_on_load, ())


def written(send) -> bytes:
    """The bytes `send(writer)` puts on a pipe."""
    read_end, write_end = os.pipe()
    try:
        writer = ChannelWriter(write_end)
        send(writer)
        writer.flush()
        os.close(write_end)
        write_end = None
        chunks = []
        while chunk := os.read(read_end, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(read_end)
        if write_end is not None:
            os.close(write_end)


def metric(step: int) -> MetricRecord:
    return MetricRecord(step=step, rank=0, values={"loss": 1.0 / (step + 1)}, time=100.0 + step)


EVENTS = [
    metric(0),
    Progress(rank=0, step=1, total=10, elapsed=0.5),
    PeakResources(rank=1, peak_rss_bytes=1 << 20, peak_gpu_bytes=None),
    Result(rank=0, value={"weights": [1.0, 2.0]}),
    WorkerRaised(rank=1, exception="ValueError: x", traceback="Traceback ...", time=3.0),
]


def send_all(writer: ChannelWriter) -> None:
    for event in EVENTS:
        writer.send(event)


def test_several_events_in_one_chunk():
    data = written(send_all)
    assert ChannelReader(rank=0).feed(data) == EVENTS


def test_an_event_split_across_chunks_byte_by_byte():
    data = written(send_all)
    reader = ChannelReader(rank=0)
    received = []
    completed_at = []
    for index in range(len(data)):
        events = reader.feed(data[index : index + 1])
        if events:
            completed_at.append(index)
        received += events
    assert received == EVENTS
    # Each event comes out with its last byte, not before: five separate frames.
    assert len(completed_at) == len(EVENTS) and completed_at[-1] == len(data) - 1


def test_batched_events_keep_their_order_and_go_before_an_unbatched_one():
    def send(writer: ChannelWriter) -> None:
        for step in range(5):
            writer.send(metric(step), batch=True)
        writer.send(Progress(rank=0, step=5, total=5, elapsed=1.0))
        writer.send(metric(5), batch=True)

    events = ChannelReader(rank=0).feed(written(send))
    assert events == [*[metric(step) for step in range(5)], Progress(0, 5, 5, 1.0), metric(5)]


def test_an_unreadable_frame_becomes_one_event_and_the_stream_continues():
    def send(writer: ChannelWriter) -> None:
        writer.send(metric(0))
        writer.send(Result(rank=3, value=OnlyInTheWorker()))
        writer.send(metric(1))

    events = ChannelReader(rank=3).feed(written(send))
    assert len(events) == 3
    assert events[0] == metric(0) and events[2] == metric(1)
    assert isinstance(events[1], Unreadable) and events[1].rank == 3
    assert "no such class here" in events[1].reason


def test_an_event_that_cannot_be_pickled_raises_and_writes_nothing():
    def send(writer: ChannelWriter) -> None:
        writer.send(metric(0), batch=True)
        with pytest.raises(Exception, match="pickle"):
            writer.send(Result(rank=0, value=lambda: None))
        writer.send(metric(1))

    # The pending batch was neither lost nor split by the failed send.
    assert ChannelReader(rank=0).feed(written(send)) == [metric(0), metric(1)]


def test_a_channel_reset_by_a_worker_that_ended_reads_as_its_end_after_what_it_sent():
    # Stop pressed at a worker's prompt: the answer is sent, and the worker is ended
    # before it reads it. Its channel is then reset rather than closed.
    launcher, worker = socket.socketpair()
    with launcher:
        worker.sendall(b"events")
        launcher.sendall(b"the run was stopped")
        worker.close()
        assert read_some(launcher.fileno()) == b"events"
        assert read_some(launcher.fileno()) == b""


def test_what_comes_down_the_link_arrives_whole_and_in_order_and_then_its_end():
    # Prompt answers and live calls go down the same socket the events come up.
    launcher, worker = socket.socketpair()
    with launcher, worker:
        writer = ChannelWriter(worker.fileno())
        sent = [Answer("c"), Answer(None, "nobody can answer input here"), {"call": 1}]
        launcher.sendall(b"".join(frame(obj) for obj in sent))
        writer.send(metric(0))
        launcher.shutdown(socket.SHUT_WR)  # the launcher ends its side: no more calls
        assert [writer.receive() for _ in sent] == sent
        assert writer.receive() is None
        writer.send(metric(1))  # events still go up
        assert ChannelReader(rank=0).feed(read_some(launcher.fileno())) == [metric(0), metric(1)]


def voluntary_switches(thread_id: int) -> int:
    """How many times the thread `thread_id` of this process went to sleep and was woken."""
    status = Path(f"/proc/self/task/{thread_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux's /proc")
def test_a_worker_waiting_for_a_call_sleeps_while_the_launcher_takes_its_events():
    # Linux wakes a thread blocked in read() on a stream socket each time the other side
    # takes what its own side wrote: once per event a live worker sent up, before.
    launcher, worker = socket.socketpair()
    with launcher, worker:
        writer = ChannelWriter(worker.fileno())
        received = []
        reader = threading.Thread(target=lambda: received.append(writer.receive()))
        reader.start()
        waiting = time.monotonic() + 10
        while reader.native_id is None or voluntary_switches(reader.native_id) == 0:
            assert time.monotonic() < waiting, "the reading thread never waited"
            time.sleep(0.01)
        before = voluntary_switches(reader.native_id)
        for step in range(200):
            writer.send(metric(step))
            events = ChannelReader(rank=0).feed(launcher.recv(1 << 16))
            assert events == [metric(step)]
        woken = voluntary_switches(reader.native_id) - before
        launcher.sendall(frame({"call": 1}))
        reader.join(10)
        assert received == [{"call": 1}]
        assert woken < 20, f"the waiting reader was woken {woken} times by 200 events sent up"


def test_a_frame_down_the_link_waits_for_its_reader_until_the_deadline():
    launcher, worker = socket.socketpair()
    with launcher, worker:
        launcher.setblocking(False)  # as the supervisor's ends are
        data = frame(b"x" * (8 << 20))  # more than the socket holds
        with pytest.raises(TimeoutError, match="did not read what was sent"):
            write_before(launcher.fileno(), data, time.monotonic() + 0.2)  # nobody reads
        taken = bytearray()

        def read_all() -> None:
            while chunk := worker.recv(1 << 16):
                taken.extend(chunk)

        reader = threading.Thread(target=read_all)
        reader.start()
        write_before(launcher.fileno(), data, time.monotonic() + 60)  # a reader takes it
        launcher.shutdown(socket.SHUT_WR)
        reader.join(60)
        assert bytes(taken[-len(data) :]) == data
