"""One loopback "node" of two-node runs of `separate_dirs.train` (for test_two_nodes.py).

    python node_run.py OUT NODE_RANK RUNS_JSON

RUNS_JSON lists the runs to make one after another, each a dict of `port`,
`base` (this node's own directory) and `options` (`train`'s keyword
arguments): each runs 2 workers as node NODE_RANK of 2. Writes the list of
this node's results of every run to OUT. The runs share one interpreter, so
its imports are paid once for all of them.
"""

from __future__ import annotations

import json
import sys
import warnings

import separate_dirs
import torch

from notebook_accel import notebook_launcher

if __name__ == "__main__":
    warnings.simplefilter("ignore")  # 4 workers on fewer cores
    out, node_rank, runs = sys.argv[1:4]
    # The first optimizer imports torch._dynamo: once here, not in every worker.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    results = [
        notebook_launcher(
            separate_dirs.train,
            args=(run["base"],),
            kwargs=run["options"],
            num_processes=2,
            num_nodes=2,
            node_rank=int(node_rank),
            master_addr="127.0.0.1",
            use_port=run["port"],
            return_all=True,
            live=False,
            backend="cpu",
            timeout=150,
        )
        for run in json.loads(runs)
    ]
    torch.save(results, out)
