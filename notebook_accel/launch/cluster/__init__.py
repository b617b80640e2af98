"""Workers on a Ray cluster, driven from one kernel.

request.py   what a launch asks of the cluster, and whether the cluster can hold it
connect.py   the ray package, the kernel's connection, what the cluster's nodes have
plan.py      the checks before anything starts, and the request
pool.py      the placement group and its agents, ranked by node, kept warm, released
agent.py     the actor on each node that forks its rank's worker and relays its bytes
group.py     the kernel's WorkerGroupBase for them (launch/attempt.py opens it)
"""

from __future__ import annotations


def release_cluster() -> bool:
    """Release now the Ray workers this kernel keeps warm after a run (`keep_warm`),
    freeing their GPUs and CPUs for the cluster's other work; say whether there were any.

    A stopped, timed-out or failed-node run releases its workers by itself; so does
    the kernel's end.
    """
    from notebook_accel.launch.cluster.pool import release_idle

    return release_idle()
