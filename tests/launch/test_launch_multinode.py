"""Two launcher calls in two processes, as node 0 and node 1, form one group, and a
worker lost on one node fails the launches of both."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from tests_support import run_together, suite_port

# Every test here runs with forked workers and with workers that get the function by
# value (tests/conftest.py says why not a third time under "spawn").
pytestmark = pytest.mark.usefixtures("each_way_to_ship")

TRAIN_MODULE = textwrap.dedent("""
    import os, signal, sys, warnings, torch, torch.distributed as dist
    from notebook_accel import Accelerator, WorkerError, notebook_launcher, set_seed

    def train():
        # The group the launcher's variables describe, made as plain torch code makes it;
        # the Accelerator then trains in it.
        dist.init_process_group("gloo")
        rank_sum = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(rank_sum)
        accelerator = Accelerator()
        set_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for _ in range(2):
            for x, y in loader:
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        weights = accelerator.unwrap_model(model).state_dict()
        return dist.get_rank(), dist.get_world_size(), rank_sum.item(), weights

    def lose_rank_2():
        # Node 1's first worker dies once the group of four has formed; the others wait
        # for it in a collective.
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.barrier()

    if __name__ == "__main__":
        warnings.simplefilter("ignore")  # 4 workers on fewer cores
        out, node_rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        if node_rank < 0:
            results = notebook_launcher(train, num_processes=4, timeout=120, live=False,
                                        return_all=True, backend="cpu")
        else:
            node = dict(num_processes=2, num_nodes=2, node_rank=node_rank,
                        master_addr="127.0.0.1", timeout=120, live=False, backend="cpu")
            results = notebook_launcher(train, use_port=port, return_all=True, **node)
            try:  # a port of its own: node 1 cannot reach node 0's store of the run before
                notebook_launcher(lose_rank_2, use_port=int(sys.argv[4]), **node)
                lost = None
            except WorkerError as error:
                lost = [(failure.rank, failure.exitcode) for failure in error.failures]
            results = results, lost
        torch.save(results, out)
""")


@pytest.fixture(scope="module")
def one_group_of_four(tmp_path_factory):
    """What one launch of 4 workers on one node returns: the reference for both ways to
    ship (how the function reaches the workers does not change what they compute)."""
    import torch

    directory = tmp_path_factory.mktemp("one_node")
    script = directory / "train.py"
    script.write_text(TRAIN_MODULE)
    [(code, _, err)] = run_together(
        [[sys.executable, str(script), str(directory / "single.pt"), "-1", "0"]], timeout=150
    )
    assert code == 0, err
    return torch.load(directory / "single.pt", weights_only=False)


@pytest.mark.timeout(300)
def test_two_nodes_of_two_form_one_group_of_four_train_to_its_weights_and_fail_together(
    tmp_path, one_group_of_four
):
    import torch

    script = tmp_path / "train.py"
    script.write_text(TRAIN_MODULE)
    ports = [str(suite_port()), str(suite_port())]
    nodes = run_together(
        [
            [sys.executable, str(script), str(tmp_path / f"node{rank}.pt"), str(rank), *ports]
            for rank in (0, 1)
        ],
        timeout=240,
    )
    if any(code != 0 for code, _, _ in nodes):  # both nodes' errors in full
        pytest.fail(
            "\n\n".join(f"node {n} exited {c}:\n{e[-3000:]}" for n, (c, _, e) in enumerate(nodes))
        )
    (node0, lost0), (node1, lost1) = (
        torch.load(tmp_path / f"node{rank}.pt", weights_only=False) for rank in (0, 1)
    )
    # Each node's launcher returns its own ranks, numbered after the nodes before it.
    assert [result[:3] for result in node0] == [(0, 4, 6.0), (1, 4, 6.0)]
    assert [result[:3] for result in node1] == [(2, 4, 6.0), (3, 4, 6.0)]
    assert [result[:3] for result in one_group_of_four] == [(r, 4, 6.0) for r in range(4)]
    four = one_group_of_four[0][3]
    for *_, weights in node0 + node1:
        assert weights.keys() == four.keys()
        for name in four:
            torch.testing.assert_close(weights[name], four[name], rtol=0, atol=1e-6)
    # A worker killed on node 1 fails node 0's launch too, where only its own workers'
    # lost connections are seen: node 1's names the killed worker first.
    assert lost1 is not None and lost1[0] == (2, -signal.SIGKILL), lost1
    assert lost0 is not None and lost0[0][0] in (0, 1), lost0
