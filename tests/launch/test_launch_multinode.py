"""Two launcher calls in two processes, as node 0 and node 1, form one group."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests_support import free_port, run_together

# Every test here runs with forked workers and with workers that get the function by
# value (tests/conftest.py says why not a third time under "spawn").
pytestmark = pytest.mark.usefixtures("each_way_to_ship")

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
                                timeout=60, backend="cpu")
    print("RESULTS", results)
""")


def test_two_nodes_of_two_workers_form_one_group_of_four(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    port = free_port()
    finished = run_together(
        [[sys.executable, str(script), str(rank), str(port)] for rank in (0, 1)], timeout=90
    )
    for code, _, err in finished:
        assert code == 0, err
    results = [eval(out.split("RESULTS", 1)[1]) for _, out, _ in finished]
    assert results[0] == [(0, 4, 6.0), (1, 4, 6.0)]
    assert results[1] == [(2, 4, 6.0), (3, 4, 6.0)]


TRAIN_MODULE = textwrap.dedent("""
    import sys, warnings, torch
    from notebook_accel import Accelerator, notebook_launcher, set_seed

    def train():
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
        return accelerator.unwrap_model(model).state_dict()

    if __name__ == "__main__":
        warnings.simplefilter("ignore")  # 4 workers on fewer cores
        out, node_rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        if node_rank < 0:
            weights = notebook_launcher(train, num_processes=4, timeout=120, live=False,
                                        backend="cpu")
        else:
            weights = notebook_launcher(train, num_processes=2, num_nodes=2, node_rank=node_rank,
                                        use_port=port, timeout=120, live=False, backend="cpu")
        torch.save(weights, out)
""")


def test_two_nodes_of_two_train_to_the_weights_of_one_group_of_four(tmp_path):
    import torch

    script = tmp_path / "train.py"
    script.write_text(TRAIN_MODULE)
    port = free_port()
    nodes = run_together(
        [
            [sys.executable, str(script), str(tmp_path / f"node{rank}.pt"), str(rank), str(port)]
            for rank in (0, 1)
        ],
        timeout=150,
    )
    assert [code for code, _, _ in nodes] == [0, 0], nodes
    [(code, _, err)] = run_together(
        [[sys.executable, str(script), str(tmp_path / "single.pt"), "-1", "0"]], timeout=150
    )
    assert code == 0, err
    four = torch.load(tmp_path / "single.pt")
    two_by_two = torch.load(tmp_path / "node0.pt")
    assert four.keys() == two_by_two.keys()
    for name in four:
        torch.testing.assert_close(two_by_two[name], four[name], rtol=0, atol=1e-6)
