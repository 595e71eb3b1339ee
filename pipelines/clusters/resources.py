"""Worker resources: what one node of each component needs, and the check that a graph's annotations can be met
by the live workers (a node whose resources no worker has would wait forever in `no-worker`).

Every cluster kind's workers carry resource `CPU=1` (env shards) or `GPU=1` (actor, inference; logical on CPU-only
machines): the embedded cluster starts them so, an existing cluster's workers were started with
`--resources CPU=1` / `--resources GPU=1` (docker-compose.yml).
"""
from __future__ import annotations

from collections import Counter

from pipelines.clusters.errors import PlacementError
from pipelines.clusters.info import cluster_info

RESOURCES = {"env": {"CPU": 1}, "rollout": {"GPU": 1}, "actor": {"GPU": 1}}  # what one node of each needs


def _resource_summary(workers: dict) -> str:
    counts = Counter(",".join(f"{k}={v:g}" for k, v in sorted(w.get("resources", {}).items())) or "no resources"
                     for w in workers.values())
    return ", ".join(f"{r} on {n} worker{'s' if n != 1 else ''}" for r, n in sorted(counts.items()))


def check_resources(nodes, workers: dict) -> None:
    """Every node's `resources` annotation is met by at least one worker, and by one of its pinned workers when
    it is pinned (`workers` annotation without `allow_other_workers=True`): else it would wait in `no-worker`.

    Args:
        nodes: (node label, annotations dict) pairs.
        workers: address -> worker info, as in `client.scheduler_info()["workers"]`.
    Raises:
        PlacementError: naming the node, the resource and the numbers.
    """
    names = {w.get("name"): a for a, w in workers.items()}
    for node, ann in nodes:
        ann = ann or {}
        pinned = [] if ann.get("allow_other_workers") else list(ann.get("workers") or [])
        pinned_live = [p if p in workers else names[p] for p in pinned if p in workers or p in names]
        if pinned and not pinned_live:
            raise PlacementError("cluster", pinned, f"node {node} is pinned to worker(s) not in the cluster "
                                                    f"({len(workers)} workers: {sorted(workers)})")
        for res, amount in (ann.get("resources") or {}).items():
            have = [a for a, w in workers.items() if w.get("resources", {}).get(res, 0) >= amount]
            if not have:
                raise PlacementError("cluster", f"{res}={amount:g}",
                                     f"node {node} needs resource {res}={amount:g}, none of the {len(workers)} "
                                     f"workers has it ({_resource_summary(workers)}); start a worker with "
                                     f"`--resources {res}={amount:g}` or drop the annotation")
            if pinned and not set(pinned_live) & set(have):
                raise PlacementError("cluster", f"{res}={amount:g}",
                                     f"node {node} is pinned to {pinned_live}, without resource {res}={amount:g} "
                                     f"({len(have)} of the {len(workers)} workers have it)")


def check_graph(graph, client) -> None:
    """Before submitting `graph` (a HighLevelGraph): every layer's annotations can be met (`check_resources`).

    Args:
        client: a distributed Client, or its `scheduler_info()` dict.
    """
    workers = cluster_info(client)["workers"]
    check_resources([(name, layer.annotations) for name, layer in graph.layers.items()], workers)

