"""The Dask cluster: an embedded local cluster of worker processes, or an existing scheduler; and placement.

Local cluster (default): a scheduler and dashboard bound to 127.0.0.1, `num_env_workers` processes named
`env-i` with resource `CPU=1` that host env shards, and `num_gpu_workers` processes named `gpu-i` with resource
`GPU=1` for the actor update (a logical resource on CPU-only machines; with CUDA, `CUDA_VISIBLE_DEVICES=i`).
Remote (`cluster.address=tcp://host:8786`): workers must have been started with `--resources CPU=1` or
`--resources GPU=1` (docker-compose.yml shows how); resources are checked before anything is submitted.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from tasks.config import Config, ConfigError


class PlacementError(ConfigError):
    """The cluster cannot run the placement the config asks for."""


@dataclass
class Placement:
    """Worker addresses per component: env shard s -> env worker, eval shard s -> same, actor -> GPU worker."""

    shard_workers: list[str]
    actor_worker: str
    env_workers: list[str] = field(default_factory=list)
    gpu_workers: list[str] = field(default_factory=list)


@dataclass
class ClusterHandle:
    client: object
    cluster: object | None
    dashboard_link: str

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()


def _worker_env(cuda_device: int | None, simulator: str) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if simulator == "maniskill":
        from tasks.envs.vulkan import vulkan_env
        env.update(vulkan_env())
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
    return env


def start_cluster(cfg: Config) -> ClusterHandle:
    """Start the embedded local cluster or connect to `cluster.address`.

    Raises:
        ConnectionError (remote scheduler unreachable, with the address and the fix).
    """
    from distributed import Client
    c = cfg.cluster
    for name in ("distributed", "distributed.nanny", "distributed.scheduler", "distributed.worker",
                 "distributed.core", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if c.address:
        client = connect(c.address, c.connect_timeout_s)
        return ClusterHandle(client, None, client.dashboard_link)
    from distributed import Nanny, Scheduler, SpecCluster
    import torch
    n_cuda = torch.cuda.device_count()
    common = {"nthreads": c.threads_per_worker, "host": "127.0.0.1", "memory_limit": c.memory_limit,
              "silence_logs": logging.ERROR, "dashboard": False}
    # torch threads of the actor: the cores the env workers leave (1 on a 2-core machine, where 2 threads were
    # measured no faster idle and up to 18x slower under load)
    actor_threads = max(1, (os.cpu_count() or 1) - c.num_env_workers)
    workers = {}
    for i in range(c.num_env_workers):
        workers[f"env-{i}"] = {"cls": Nanny, "options": {**common, "name": f"env-{i}", "resources": {"CPU": 1},
                                                         "env": _worker_env(None, cfg.env.simulator)}}
    for i in range(c.num_gpu_workers):
        workers[f"gpu-{i}"] = {"cls": Nanny, "options": {
            **common, "name": f"gpu-{i}", "resources": {"GPU": 1},
            "env": {**_worker_env(i if n_cuda else None, "none"), "OMP_NUM_THREADS": str(actor_threads)}}}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": c.dashboard_address}}
    cluster = SpecCluster(scheduler=scheduler, workers=workers, silence_logs=logging.ERROR)
    client = Client(cluster)
    client.wait_for_workers(len(workers), timeout=120)
    return ClusterHandle(client, cluster, client.dashboard_link)


def connect(address: str, timeout_s: float):
    """A Client for an existing scheduler, or ConnectionError (one line, with the fix) within `timeout_s`.

    The deadline is enforced here: distributed's own `timeout` does not cover a peer that accepts the TCP
    connection but never answers the handshake (a wrong port), where `Client()` would wait forever.
    """
    import threading
    from distributed import Client
    fix = ("start it (`dask scheduler`, `docker compose up`) or drop cluster.address for the embedded local "
           "cluster")
    box: dict = {}

    def attempt():  # in a daemon thread, so a hung handshake cannot keep the process alive
        try:
            box["client"] = Client(address, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    t = threading.Thread(target=attempt, daemon=True, name="dagrl-connect")
    t.start()
    t.join(timeout_s + 5)
    if "client" in box:
        return box["client"]
    if "error" in box:
        raise ConnectionError(f"cluster.address={address!r}: cannot reach the scheduler ({box['error']}); "
                              f"{fix}") from None
    raise ConnectionError(f"cluster.address={address!r}: no Dask scheduler answered within {timeout_s:.0f} s "
                          f"(cluster.connect_timeout_s); {fix}")


def plan_placement(cfg: Config, client) -> Placement:
    """Map env shards to `CPU` workers (round-robin) and the actor to the first `GPU` worker.

    Raises:
        PlacementError: no worker has a resource a component needs (a task would wait forever in `no-worker`).
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    by_name = sorted(info.items(), key=lambda kv: str(kv[1].get("name")))
    env_w = [a for a, w in by_name if w.get("resources", {}).get("CPU", 0) >= 1]
    gpu_w = [a for a, w in by_name if w.get("resources", {}).get("GPU", 0) >= 1]
    if not env_w:
        raise PlacementError("cluster", f"{len(info)} workers, none with resource CPU",
                             "env shards need workers started with `--resources CPU=1`")
    if not gpu_w:
        raise PlacementError("cluster", f"{len(info)} workers, none with resource GPU",
                             "the actor needs a worker started with `--resources GPU=1` (logical on CPU machines)")
    shards = [env_w[s % len(env_w)] for s in range(cfg.env.num_shards)]
    return Placement(shard_workers=shards, actor_worker=gpu_w[0], env_workers=env_w, gpu_workers=gpu_w)


def cluster_rss_bytes() -> int:
    """Resident memory of this driver process and all its child processes (scheduler, nannies, workers)."""
    import psutil
    me = psutil.Process()
    total = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total
