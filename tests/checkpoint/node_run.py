"""One loopback "node" of a two-node run of `separate_dirs.train` (for test_two_nodes.py).

    python node_run.py OUT NODE_RANK PORT BASE OPTIONS_JSON

Runs 2 workers as node NODE_RANK of 2, saving into BASE (this node's own
directory), and writes this node's results, or its WorkerError's rank and
exit code, to OUT.
"""

from __future__ import annotations

import json
import sys
import warnings

import separate_dirs
import torch

from notebook_accel import WorkerError, notebook_launcher

if __name__ == "__main__":
    warnings.simplefilter("ignore")  # 4 workers on fewer cores
    out, node_rank, port, base, options = sys.argv[1:6]
    # The first optimizer imports torch._dynamo: once here, not in every worker.
    torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    try:
        results = notebook_launcher(
            separate_dirs.train,
            args=(base,),
            kwargs=json.loads(options),
            num_processes=2,
            num_nodes=2,
            node_rank=int(node_rank),
            master_addr="127.0.0.1",
            use_port=int(port),
            return_all=True,
            live=False,
            backend="cpu",
            timeout=150,
        )
    except WorkerError as error:
        results = {"failed": error.rank, "exitcode": error.exitcode}
    torch.save(results, out)
