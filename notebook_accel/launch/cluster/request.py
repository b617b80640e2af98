"""What a launch asks of a Ray cluster, and whether the cluster could ever give it.

Plain data and arithmetic: nothing here imports Ray, so the checks are the
same whoever asks (the launcher, the panel) and can be tested without a
cluster. A Ray placement group the cluster cannot hold would wait forever;
`unmet` says so before one is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Ray's placement strategies: PACK fills nodes one after another, SPREAD spreads
# the workers as far as it can; the STRICT_ ones refuse anything else.
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# What `cluster=` takes: "local" (this machine's processes) or "ray".
CLUSTERS = ("local", "ray")


@dataclass(frozen=True)
class NodeResources:
    """One live node of the cluster, as Ray reports it."""

    node_id: str
    address: str
    cpus: float
    gpus: float

    def describe(self) -> str:
        """ "node 10.0.0.7 (3f2a9c01)": its address and the start of its id (nodes of a
        test cluster on one machine share the address)."""
        return f"node {self.address} ({self.node_id[:8]})"

    def slots(self, cpus: float, gpus: float) -> int:
        """How many bundles of `cpus` CPUs and `gpus` GPUs this node can hold."""
        fits = [
            math.floor(have / need + 1e-9)
            for have, need in ((self.cpus, cpus), (self.gpus, gpus))
            if need
        ]
        return min(fits) if fits else 0


@dataclass(frozen=True)
class ClusterRequest:
    """The workers a launch asks of a Ray cluster (checked options, see launch/options.py)."""

    # None: this kernel's Ray connection, $RAY_ADDRESS, or else a new local cluster.
    address: str | None
    workers: int
    gpus_per_worker: int
    cpus_per_worker: float
    strategy: str = "PACK"
    # Exactly this many workers on each node used (a bundle per node), when given.
    workers_per_node: int | None = None
    # Seconds the workers' processes stay up after a run, for the next one to reuse.
    keep_warm: float = 120.0
    # The function and its arguments, packed by value (launch/packing.py).
    shipped: bytes = field(default=b"", repr=False, compare=False)

    @property
    def shape(self) -> tuple:
        """What two requests must share for one's warm workers to serve the other."""
        return (
            self.workers,
            self.gpus_per_worker,
            self.cpus_per_worker,
            self.strategy,
            self.workers_per_node,
        )

    @property
    def per_bundle(self) -> int:
        """Workers per placement-group bundle: a node's worth, or one."""
        return self.workers_per_node or 1

    @property
    def placement_strategy(self) -> str:
        # One bundle per node: each on a node of its own.
        return "STRICT_SPREAD" if self.workers_per_node else self.strategy

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles: one per worker, or one per node."""
        bundle = {"CPU": self.cpus_per_worker * self.per_bundle}
        if self.gpus_per_worker:
            bundle["GPU"] = float(self.gpus_per_worker * self.per_bundle)
        return [dict(bundle) for _ in range(self.workers // self.per_bundle)]

    def bundle_of(self, worker: int) -> int:
        return worker // self.per_bundle

    def describe(self) -> str:
        """ "2 workers of 1 CPU each, packed onto as few nodes as possible" """
        each = amount(self.cpus_per_worker, "CPU")
        if self.gpus_per_worker:
            each = f"{amount(self.gpus_per_worker, 'GPU')} and {each}"
        where = {
            "PACK": "packed onto as few nodes as possible",
            "SPREAD": "spread over as many nodes as possible",
            "STRICT_PACK": "all on one node",
            "STRICT_SPREAD": "each on a node of its own",
        }[self.strategy]
        if self.workers_per_node:
            where = (
                f"{self.workers_per_node} on each of {self.workers // self.workers_per_node} nodes"
            )
        return f"{amount(self.workers, 'worker')} of {each} each, {where}"


def unmet(request: ClusterRequest, nodes: list[NodeResources]) -> str | None:
    """Why the cluster's nodes can never hold `request`, or None when they can
    (even if other work holds part of them now)."""
    bundles = request.bundles()
    slots = [node.slots(bundles[0].get("CPU", 0.0), bundles[0].get("GPU", 0.0)) for node in nodes]
    # How many bundles the nodes hold: STRICT_PACK on one node, STRICT_SPREAD one a node.
    strict = {"STRICT_PACK": max(slots, default=0), "STRICT_SPREAD": sum(n >= 1 for n in slots)}
    if strict.get(request.placement_strategy, sum(slots)) >= len(bundles):
        return None
    return f"it asks for {request.describe()}, but {_what_there_is(nodes, request)}"


def _what_there_is(nodes: list[NodeResources], request: ClusterRequest) -> str:
    if not nodes:
        return "the cluster has no live node"
    unit = "GPU" if request.gpus_per_worker else "CPU"
    have = [node.gpus if request.gpus_per_worker else node.cpus for node in nodes]
    listed = ", ".join(
        f"{node.describe()} {amount(each, unit)}" for node, each in zip(nodes, have, strict=True)
    )
    total = f"{amount(sum(have), unit)} in all, on {amount(len(nodes), 'node')}"
    return f"the cluster has {total}: {listed}"


def amount(value: float, unit: str) -> str:
    """ "1 GPU", "2 CPUs", "0.5 CPUs" """
    number = int(value) if float(value).is_integer() else round(value, 2)
    return f"{number} {unit}{'s' if number != 1 else ''}"
