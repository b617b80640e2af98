"""Workers on a Ray cluster, driven from one kernel (its modules: docs/architecture.md)."""


def release_cluster() -> bool:
    """Release now the Ray workers this kernel keeps warm after a run (`keep_warm`),
    freeing their GPUs and CPUs for the cluster's other work; say whether there were any.

    A stopped, timed-out or failed-node run releases its workers by itself; so does
    the kernel's end.
    """
    from notebook_accel.launch.cluster.pool import release_idle

    return release_idle()
