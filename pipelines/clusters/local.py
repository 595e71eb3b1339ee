"""`cluster.kind=local` (the default): the embedded local Dask cluster this driver starts and closes.

A scheduler and workers bound to `cluster.host` and a dashboard on `cluster.dashboard_address` (both 127.0.0.1
unless configured), `num_env_workers` processes named `env-i` with resource `CPU=1` that host env shards, and one
process `gpu-i` with resource `GPU=1` per device for the actor and inference: on a machine with N CUDA devices one
per device (`cluster.num_gpus` of them, all N when null) with `CUDA_VISIBLE_DEVICES=i`; on CPU-only machines
`cluster.num_gpus` (when set) or `num_gpu_workers` logical ones. TLS (`cluster.security`): every process speaks
tls:// with a per-run certificate or the given ones.

The kind's interface (`pipelines.clusters.ClusterKind`): `start`, `check_machine`, `devices`, `env_served`,
`rejoin`, `describe`, `attach`, `TLS_ROLES`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from pipelines.clusters.checks import check_cluster, check_local, inert_local
from pipelines.clusters.errors import PlacementError
from pipelines.clusters.handle import ClusterHandle, scheduler_config
from pipelines.clusters.info import wait_for_workers
from pipelines.clusters.tls import TLS_FILES, security
from tasks.config import Config, ConfigError, register_family
from tasks.config.schema import ClusterConfig


@register_family("cluster", "local", checks=(check_cluster, check_local))
@dataclass(frozen=True)
class LocalClusterConfig(ClusterConfig):
    """`cluster` with `kind: local`: the embedded cluster's processes (conf/cluster/local.yaml)."""

    kind: str = "local"
    host: str = "127.0.0.1"  # the interface the embedded cluster's scheduler and workers bind to (0.0.0.0: all)
    num_env_workers: int = 2  # processes env-i (resource CPU=1) hosting the env shards
    num_gpu_workers: int = 1  # logical GPU workers on a CPU-only machine (with CUDA: one per device)
    # torch intra-op threads of each GPU-resource (actor) worker; None: the cores the env workers leave
    # (os.cpu_count() - num_env_workers, at least 1). Idle threads sleep (OMP_WAIT_POLICY=PASSIVE) rather than
    # spin, so more threads than free cores degrade gracefully (docs/guides/tracking_performance.md)
    actor_threads: Optional[int] = None
    dashboard_address: str = "127.0.0.1:8787"  # the scheduler's dashboard (":8787": every interface)
    start_timeout_s: float = 120.0  # every worker up within this, else one-line error
    WORKERS_HERE: ClassVar[bool] = True  # the workers run on this machine (policy.device=cuda needs CUDA here)
    inert_keys = staticmethod(inert_local)  # value-dependent keys that do nothing (tasks.config.checks.inert)

    @property
    def env_workers(self) -> int:
        """The env workers this kind starts: `num_env_workers` (the offline memory estimates count on them)."""
        return self.num_env_workers


TLS_ROLES = TLS_FILES  # the driver starts the scheduler and the workers: every role's certificate


def _cuda_count() -> int:
    from pipelines.clusters import placement
    return placement._cuda_device_count()


def check_machine(cfg: Config, cuda_count: int) -> None:
    """Raise PlacementError when `cluster.num_gpus` asks for more CUDA devices than this machine has."""
    c = cfg.cluster
    if cuda_count and c.num_gpus is not None and c.num_gpus > cuda_count:
        raise PlacementError("cluster.num_gpus", c.num_gpus, f"this machine has {cuda_count} CUDA device"
                                                             f"{'s' if cuda_count != 1 else ''}; use at most "
                                                             f"{cuda_count}, or null for all of them")


def devices(cfg: Config, cuda_count: int) -> tuple[int, str]:
    """(devices, where the number comes from) with `cluster.num_gpus` null: this machine's CUDA devices, or on a
    CPU-only machine `cluster.num_gpu_workers` logical ones."""
    if cuda_count:
        return cuda_count, f"{cuda_count} CUDA device{'s' if cuda_count != 1 else ''}"
    n = cfg.cluster.num_gpu_workers
    return n, f"cluster.num_gpu_workers={n}, no CUDA device"


def env_served(cfg: Config, n: int) -> list[int]:
    """The device each env worker serves, known before start: env worker j serves device j % n (one host:
    `placement._env_devices` round-robins over every GPU worker)."""
    return [j % n for j in range(cfg.cluster.num_env_workers)]


def rejoin(cfg: Config) -> tuple[int, float]:
    """(workers the cluster has when whole, seconds to wait for them after a restart) for the driver's watch."""
    return cfg.cluster.num_env_workers + cfg.cluster.num_gpu_workers, 120.0


def describe(cfg: Config, num_devices: int | None) -> str:
    """One line for `pipelines.validate`: the workers this kind starts (`num_devices` GPU workers when known)."""
    c = cfg.cluster
    return f"local, {c.num_env_workers} env workers (CPU) + {num_devices or c.num_gpu_workers} GPU workers"


def attach(cfg: Config):
    """There is no running cluster to attach to before `start`: ConfigError naming cluster.address (the
    `--connect` of pipelines.validate checks an existing cluster)."""
    raise ConfigError("cluster.address", None, "--connect checks an existing cluster: give cluster.kind=address "
                                               "cluster.address=tcp://HOST:PORT (pipelines.run starts the embedded "
                                               "one itself)")


def _worker_env(cuda_device: int | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a worker process: one thread per BLAS, no Python warnings, `extra` (what the simulator's
    processes need: `tasks.envs.worker_env`), and `CUDA_VISIBLE_DEVICES` for a GPU worker of a CUDA device."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(extra or {})}
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
    return env


def gpu_worker_specs(cfg: Config, cuda_count: int) -> list[tuple[str, int | None]]:
    """(name, CUDA device or None) of the embedded cluster's GPU workers: one per device.

    Raises:
        PlacementError: `cluster.num_gpus` above the machine's CUDA devices, or a placement the devices cannot hold
        (checked here so that no worker starts for a run that cannot be placed).
    """
    from pipelines.clusters.placement import check_placement, num_devices
    n, _ = num_devices(cfg, cuda_count)
    check_placement(cfg, cuda_count)  # also: cluster.num_gpus above the machine's CUDA devices
    return [(f"gpu-{i}", i if cuda_count else None) for i in range(n)]


MALLOC_TRIM = "MALLOC_TRIM_THRESHOLD_"
_USER_MALLOC_TRIM = os.environ.get(MALLOC_TRIM)  # a value the user exported before dagrl started (kept)


def glibc_malloc_defaults() -> None:
    """Spawn the embedded cluster's worker processes with glibc's default malloc thresholds, not with the
    `MALLOC_TRIM_THRESHOLD_=65536` a Dask Nanny puts into every worker's environment
    (`distributed.nanny.pre-spawn-environ`; it also leaves it in this process's `os.environ`, where later spawns
    would inherit it): call before the Nannies are built.

    Why: setting the trim threshold at all switches off glibc's dynamic mmap threshold (mallopt(3)), so every
    tensor above 128 KiB (a 400 x 256 float32 activation is 400 KiB) is mmapped and unmapped again on each
    allocation, and each of its pages faults on first touch. Measured (`benchmarks/update_gap.py --dask`): the
    default PPO update inside the actor worker took ~130 000 minor page faults per update with it and none in a
    plain process. A value the user exported before dagrl started is left as it is."""
    import dask
    dask.config.set({f"distributed.nanny.pre-spawn-environ.{MALLOC_TRIM}": None})
    if _USER_MALLOC_TRIM is None:
        os.environ.pop(MALLOC_TRIM, None)


def cluster_specs(cfg: Config, gpus: list[tuple[str, int | None]], sec=None) -> tuple[dict, dict]:
    """(scheduler spec, worker specs by name) of the embedded cluster for `SpecCluster`: the scheduler on
    `cluster.host` (127.0.0.1 unless configured) with its dashboard on `cluster.dashboard_address`
    (127.0.0.1:8787 unless configured), `num_env_workers` Nannies `env-i` (resource CPU=1) and one per `gpus`
    entry (name, CUDA device or None; resource GPU=1), all on `cluster.host`; with `sec` (a distributed.Security)
    every one speaks tls://.

    Raises:
        VulkanMissingError (tasks.envs.maniskill.vulkan): the simulator's processes need a Vulkan driver and
        none is found (`tasks.envs.worker_env`).
    """
    from distributed import Nanny, Scheduler

    from tasks.envs import worker_env
    c = cfg.cluster
    proto = {"protocol": "tls", "security": sec} if sec is not None else {}
    common = {"nthreads": c.threads_per_worker, "host": c.host, "memory_limit": c.memory_limit,
              "silence_logs": logging.ERROR, "dashboard": False,
              "preload": ["pipelines.worker_preload"],  # the workers ignore a terminal's Ctrl-C (the driver decides)
              "death_timeout": c.start_timeout_s, **proto}
    # death_timeout bounds each Nanny's wait for its worker process (None: a worker hanging at start-up, e.g. in a
    # driver's initialisation, would block SpecCluster forever; also bounds a restart during recovery)
    # torch threads of the actor: cluster.actor_threads, else the cores the env workers leave (1 on a 2-core
    # machine). OMP_WAIT_POLICY=PASSIVE: an OpenMP thread waiting for work sleeps instead of spinning; measured
    # (benchmarks/update_gap.py, 2 threads on 2 busy cores) 23.7 s per update spinning, 2.3 s passive
    actor_threads = c.actor_threads or max(1, (os.cpu_count() or 1) - c.num_env_workers)
    env_extra = worker_env(cfg.env)
    workers = {}
    for i in range(c.num_env_workers):
        workers[f"env-{i}"] = {"cls": Nanny, "options": {**common, "name": f"env-{i}", "resources": {"CPU": 1},
                                                         "env": _worker_env(None, env_extra)}}
    for name, device in gpus:
        workers[name] = {"cls": Nanny, "options": {
            **common, "name": name, "resources": {"GPU": 1},
            "env": {**_worker_env(device), "OMP_NUM_THREADS": str(actor_threads), "OMP_WAIT_POLICY": "PASSIVE"}}}
    scheduler = {"cls": Scheduler, "options": {"host": c.host, "dashboard_address": c.dashboard_address, **proto}}
    return scheduler, workers


def start(cfg: Config) -> ClusterHandle:
    """Start the embedded cluster (`cluster_specs`) and wait for every worker to register.

    Raises:
        PlacementError (a ConfigError) before any worker starts: more GPUs asked for than the machine or the
        config provides (`gpu_worker_specs`).
        ConnectionError: a worker did not start, or not every worker registered, within
        `cluster.start_timeout_s` (one line naming the key and the fix).
    """
    from distributed import Client, SpecCluster
    c = cfg.cluster
    sec = security(cfg)
    gpus = gpu_worker_specs(cfg, _cuda_count())
    glibc_malloc_defaults()
    scheduler, workers = cluster_specs(cfg, gpus, sec)
    fix = (f"raise cluster.start_timeout_s (now {c.start_timeout_s:g}) on a loaded machine, or start fewer workers "
           f"(cluster.num_env_workers)")
    import dask
    try:
        with dask.config.set(scheduler_config(cfg)):
            cluster = SpecCluster(scheduler=scheduler, workers=workers, silence_logs=logging.ERROR, security=sec)
    except (TimeoutError, OSError) as exc:
        raise ConnectionError(f"cluster.start_timeout_s={c.start_timeout_s:g}: a worker of the embedded cluster did "
                              f"not start ({type(exc).__name__}: {exc}); {fix}") from None
    client = Client(cluster)
    have = wait_for_workers(client, len(workers), c.start_timeout_s)
    if have < len(workers):
        ClusterHandle(client, cluster, "").close()
        raise ConnectionError(f"cluster.start_timeout_s={c.start_timeout_s:g}: only {have} of the embedded cluster's "
                              f"{len(workers)} workers registered within {c.start_timeout_s:g} s; {fix}")
    return ClusterHandle(client, cluster, client.dashboard_link,
                         dashboard_note(c.dashboard_address, client.dashboard_link))


def dashboard_note(asked: str, link: str) -> str | None:
    """One line when the embedded dashboard is not on the port `cluster.dashboard_address` (`asked`, `HOST:PORT` or
    `:PORT`) names: distributed takes another port when that one is busy (another run's or Dask cluster's dashboard)
    and says so only in a log dagrl silences. None when it is there, or when `asked` leaves the port to the system
    (port 0) or the link has no port."""
    from urllib.parse import urlparse
    want = asked.rsplit(":", 1)[-1]
    got = urlparse(link).port
    if not want.isdigit() or int(want) == 0 or got is None or got == int(want):
        return None
    return (f"dashboard on port {got}: port {want} (cluster.dashboard_address={asked}) is taken, by another dagrl "
            f"run or Dask cluster on this machine; cluster.dashboard_address=127.0.0.1:PORT chooses another")
