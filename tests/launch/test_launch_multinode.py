"""Two launcher calls in two processes, as node 0 and node 1, form one group."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

NODE_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from notebook_accel import notebook_launcher

    def train():
        dist.init_process_group("gloo")
        value = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(value)
        return dist.get_rank(), dist.get_world_size(), value.item()

    node_rank, port = int(sys.argv[1]), int(sys.argv[2])
    results = notebook_launcher(train, num_processes=2, num_nodes=2, node_rank=node_rank,
                                master_addr="127.0.0.1", use_port=port, return_all=True,
                                timeout=60)
    print("RESULTS", results)
""")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_nodes_of_two_workers_form_one_group_of_four(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    port = free_port()
    nodes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=90) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err
    results = [eval(out.split("RESULTS", 1)[1]) for out, _ in outputs]
    assert results[0] == [(0, 4, 6.0), (1, 4, 6.0)]
    assert results[1] == [(2, 4, 6.0), (3, 4, 6.0)]
