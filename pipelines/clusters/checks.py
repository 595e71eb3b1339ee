"""The cluster kinds' rules, as functions of the whole Config (registered with each kind in
pipelines/clusters/<kind>.py and run by `tasks.config.checks`). Each raises ConfigError naming the key, the value
and the fix. The placement against the devices is `pipelines.clusters.placement.check_placement` (it needs this
machine's CUDA devices and the command).
"""
from __future__ import annotations

import os

from tasks.config import Config, ConfigError
from tasks.config.schema import ClusterConfig

_SEC = "cluster.security"
_COMPONENTS = ClusterConfig.COMPONENTS


def _tls_enabled(sec) -> bool:
    from pipelines.clusters.tls import tls_enabled
    return tls_enabled(sec)


def check_cluster(cfg: Config) -> None:
    """The keys every kind has: `threads_per_worker` >= 1, `num_gpus` >= 1 or null, the components named in
    `component_placement`, and `security`'s files (each exists; a key has its cert; `temporary` or files, not
    both)."""
    from pipelines.clusters.tls import TLS_FILES
    c = cfg.cluster
    if c.threads_per_worker < 1:
        raise ConfigError("cluster.threads_per_worker", c.threads_per_worker, "must be >= 1")
    if c.num_gpus is not None and c.num_gpus < 1:
        raise ConfigError("cluster.num_gpus", c.num_gpus, "must be >= 1, or null to detect")
    for names in c.component_placement:
        for name in names.split(","):
            if name.strip() not in _COMPONENTS:
                raise ConfigError(f"cluster.component_placement.{names}", c.component_placement[names],
                                  f"unknown component {name.strip()!r}; known: {list(_COMPONENTS)}")
    sec = c.security
    for f in TLS_FILES:
        path = getattr(sec, f)
        if path and not os.path.isfile(os.path.expanduser(path)):
            raise ConfigError(f"{_SEC}.{f}", path, "no such file; give the path of a PEM file "
                                                   "(docs/guides/clusters.md, \"TLS\"; cluster.security)")
    for role in ("client", "scheduler", "worker"):
        if getattr(sec, f"tls_{role}_key") and not getattr(sec, f"tls_{role}_cert"):
            raise ConfigError(f"{_SEC}.tls_{role}_key", getattr(sec, f"tls_{role}_key"),
                              f"a key without its certificate: give {_SEC}.tls_{role}_cert too")
    if sec.temporary and any(getattr(sec, f) for f in TLS_FILES):
        first = next(f for f in TLS_FILES if getattr(sec, f))
        raise ConfigError(f"{_SEC}.temporary", True, f"makes its own certificate; {_SEC}.{first} would be ignored: "
                                                     f"drop one of them")


def check_local(cfg: Config) -> None:
    """`cluster.kind=local`: positive worker counts, threads and start timeout, a host to bind to, and TLS for
    every role (a per-run certificate, or the CA and the client's, scheduler's and workers' certificates)."""
    c = cfg.cluster
    if c.actor_threads is not None and c.actor_threads < 1:
        raise ConfigError("cluster.actor_threads", c.actor_threads,
                          "must be >= 1 (torch threads of the actor worker), or null for the free cores")
    if not c.start_timeout_s > 0:
        raise ConfigError("cluster.start_timeout_s", c.start_timeout_s,
                          "must be > 0 (seconds for the embedded cluster's workers to start)")
    if not c.host.strip():
        raise ConfigError("cluster.host", c.host, "give the interface to bind to: 127.0.0.1 (this machine "
                                                  "only) or 0.0.0.0 (every interface)")
    sec = c.security
    if _tls_enabled(sec) and not sec.temporary:
        missing = [f for f in ("tls_ca_file", "tls_client_cert", "tls_scheduler_cert", "tls_worker_cert")
                   if not getattr(sec, f)]
        if missing:
            raise ConfigError(f"{_SEC}.{missing[0]}", None, "TLS on the embedded cluster needs the CA and "
                                                            "certificates for client, scheduler and workers "
                                                            "(tls_ca_file, tls_client_cert, tls_scheduler_cert, "
                                                            f"tls_worker_cert); or set {_SEC}.temporary=true for a "
                                                            "per-run self-signed one")
    if c.num_env_workers < 1:
        raise ConfigError("cluster.num_env_workers", c.num_env_workers, "need at least 1")
    if c.num_gpu_workers < 1:
        raise ConfigError("cluster.num_gpu_workers", c.num_gpu_workers,
                          "need at least 1 (a logical GPU worker on CPU machines)")


def check_address(cfg: Config) -> None:
    """`cluster.kind=address`: an address tcp://HOST:PORT (tls:// exactly when `cluster.security` sets up TLS), a
    positive connect timeout, and TLS as a client (the CA and the client's certificate; no per-run one)."""
    c = cfg.cluster
    if c.address is None:
        raise ConfigError("cluster.address", None, "cluster.kind=address connects to an existing scheduler: give "
                                                    "cluster.address=tcp://HOST:PORT (or cluster.kind=local for "
                                                    "the embedded cluster)")
    if not str(c.address).rsplit(":", 1)[-1].isdigit():
        raise ConfigError("cluster.address", c.address, "use tcp://HOST:PORT (e.g. tcp://host:8786; "
                                                        "tls://HOST:PORT with cluster.security)")
    if not c.connect_timeout_s > 0:
        raise ConfigError("cluster.connect_timeout_s", c.connect_timeout_s,
                          "must be > 0 (seconds for the scheduler to answer)")
    sec, tls = c.security, _tls_enabled(c.security)
    if tls:
        if sec.temporary:
            raise ConfigError(f"{_SEC}.temporary", True, "a per-run certificate is for the embedded cluster only "
                                                         "(an existing scheduler cannot know it); give "
                                                         f"{_SEC}.tls_ca_file and tls_client_cert instead")
        if not sec.tls_ca_file:
            raise ConfigError(f"{_SEC}.tls_ca_file", None, "TLS to an existing scheduler needs the CA that signed "
                                                           "its certificate: give the CA's PEM file")
        if not sec.tls_client_cert:
            raise ConfigError(f"{_SEC}.tls_client_cert", None, "Dask's TLS is mutual: the client needs its own "
                                                               "certificate (signed by a CA the scheduler trusts)")
        if not c.address.startswith("tls://"):
            raise ConfigError("cluster.address", c.address, "cluster.security sets up TLS: the scheduler's address "
                                                            "is tls://HOST:PORT")
    elif c.address.startswith("tls://"):
        raise ConfigError("cluster.address", c.address, "a tls:// scheduler needs cluster.security (at least "
                                                        "cluster.security.tls_ca_file)")


def inert_local(cfg: Config, command: str = "run", cuda_count: int = 0) -> list[tuple[str, str]]:
    """`cluster.kind=local`'s keys that do nothing for this config, each with why and the fix: (key, reason).
    `cluster.num_gpu_workers` (logical GPU workers) when `cluster.num_gpus` is set or this machine has CUDA
    devices (`cuda_count`; then one GPU worker per device)."""
    c = cfg.cluster
    if c.num_gpus is not None:
        return [("cluster.num_gpu_workers", f"cluster.num_gpus={c.num_gpus} sets the GPU workers: drop one")]
    cuda = cuda_count
    if cuda:
        return [("cluster.num_gpu_workers", f"the embedded cluster starts one GPU worker per CUDA device ({cuda} "
                                            f"here); num_gpu_workers counts logical ones on CPU-only machines: use "
                                            f"cluster.num_gpus to use fewer devices")]
    return []


STARTED_WORKERS_KEYS = ("cluster.memory_limit", "cluster.threads_per_worker", "cluster.security.tls_scheduler_cert",
                        "cluster.security.tls_scheduler_key", "cluster.security.tls_worker_cert",
                        "cluster.security.tls_worker_key")  # what only a cluster this driver starts is given


def inert_address(cfg: Config, command: str = "run", cuda_count: int = 0) -> list[tuple[str, str]]:
    """`cluster.kind=address`'s inert keys: the shared keys that configure workers and a scheduler this driver
    starts (`STARTED_WORKERS_KEYS`); the existing cluster's were started with their own."""
    why = (f"configures the workers of a cluster this driver starts; with cluster.kind=address "
           f"({cfg.cluster.address}) the existing cluster's workers are used as they were started: drop it (or use "
           f"cluster.kind=local)")
    return [(k, why) for k in STARTED_WORKERS_KEYS]
