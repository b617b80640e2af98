"""cluster='ray' without an address: the kernel's own Ray cluster of this machine.

Each case runs in a fresh interpreter (the test process is already a driver of the
suite's cluster): beside another Ray cluster that holds Ray's default ports, the
kernel starts a cluster of its own rather than joining that one; and a start that
fails (a node that never registers, as on a machine too busy for Ray's 30 s) ends
every process it started and says why, with what to do. A node that missed Ray's
fixed registration wait once is started afresh, and the first start's processes end.
Each interpreter keeps Ray's files in a directory of the test's own (RAY_TMPDIR), removed
after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster_support import end_all_of, running, using

pytestmark = pytest.mark.timeout(180)

# A node whose processes start but which never registers: Ray's own start runs, then
# fails where its wait for the node would (this process's children are Ray's).
FAILED_START = """
import json, psutil, ray._private.node as node
from notebook_accel.launch.cluster import connect

real = node.Node.start_ray_processes

def started_then_lost(self, *args, **kwargs):
    real(self, *args, **kwargs)
    raise Exception("The current node timed out during startup.")

node.Node.start_ray_processes = started_then_lost
try:
    connect.connect(None)
    message = None
except RuntimeError as error:
    message = str(error)
left = [c.name() for c in psutil.Process().children(recursive=True)
        if c.status() != psutil.STATUS_ZOMBIE]
print("RESULT " + json.dumps({"message": message, "left": left}))
"""

# The first start's node never registers; the second start is Ray's own, untouched.
FIRST_START_LOST = """
import json, psutil, ray, ray._private.node as node
from notebook_accel.launch.cluster import connect

real = node.Node.start_ray_processes
first_start = []

def lost_once(self, *args, **kwargs):
    real(self, *args, **kwargs)
    if not first_start:
        first_start.extend(c.pid for c in psutil.Process().children(recursive=True))
        raise Exception("The current node timed out during startup.")

node.Node.start_ray_processes = lost_once
said = connect.connect(None)
alive = ray.get(ray.remote(lambda: "ran").remote())
first_left = [pid for pid in first_start if psutil.pid_exists(pid)
              and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
ray.shutdown()
print("RESULT " + json.dumps({"said": said, "alive": alive, "first": first_start,
                              "first_left": first_left}))
"""

OWN_CLUSTER = """
import json, ray
from notebook_accel.launch.cluster import connect

said = connect.connect(None)
address = ray.get_runtime_context().gcs_address
print("RESULT " + json.dumps({"said": said, "address": address}))
ray.shutdown()
"""


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """The interpreter's RAY_TMPDIR: short, as Ray's unix sockets live under it and a
    socket's path must fit in 107 bytes. After the test every process that uses it is
    ended and it is removed: a raylet stopped at its start can leave agents it had just
    started, which then run, orphaned, until their own start is done."""
    path = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        yield path
    finally:
        end_all_of(path)


def run(script: str, ray_tmpdir: Path, env: dict | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "RAY_TMPDIR": str(ray_tmpdir), **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_a_failed_start_stops_what_it_started_and_says_what_to_do(ray_tmpdir):
    result = run(FAILED_START, ray_tmpdir)
    assert result["left"] == []  # no gcs_server, raylet or log_monitor runs on
    # ... nor an agent the raylet was starting when it was ended, no longer the kernel's
    # descendant but still writing its logs into the start's directory.
    assert running(using(ray_tmpdir)) == set()
    message = result["message"]
    assert message.startswith("cluster='ray' without ray_address starts a Ray cluster")
    assert "timed out during startup" in message and "(2 tries)" in message
    assert "run the cell again" in message and "ray_address='auto'" in message


def test_a_node_that_missed_registration_once_is_started_afresh(ray_tmpdir):
    result = run(FIRST_START_LOST, ray_tmpdir)
    assert result["said"] == "a Ray cluster of this machine alone"
    assert result["alive"] == "ran"  # the second start's cluster runs tasks
    assert result["first"] != []  # the first start had processes of its own ...
    assert result["first_left"] == []  # ... and none of them runs on


def test_the_kernel_starts_its_own_cluster_beside_another(ray_cluster, ray_tmpdir):
    """Another cluster runs on this machine and left its address where `ray.init()`
    looks (the suite's, started with ray.cluster_utils): the kernel's is a new one."""
    # Where that interpreter's ray.init() looks: under its RAY_TMPDIR.
    (ray_tmpdir / "ray").mkdir()
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(ray_cluster.address)
    result = run(OWN_CLUSTER, ray_tmpdir, env={"RAY_ADDRESS": ""})
    assert result["said"] == "a Ray cluster of this machine alone"
    assert result["address"] != ray_cluster.address
