"""`cluster.kind=address`: an existing Dask scheduler at `cluster.address` (tcp://HOST:PORT, tls://HOST:PORT with
`cluster.security`), its workers used as they were started.

The workers must carry resource `CPU=1` (env shards) or `GPU=1` (actor, inference; one per device, device i = the
i-th GPU worker by name): `dask worker ... --resources CPU=1` (docker-compose.yml shows how). Resources are checked
before anything is submitted (`pipelines.clusters.placement.plan_placement`). The driver closes its client, never
the cluster.

The kind's interface (`pipelines.clusters.ClusterKind`): `start`, `check_machine`, `devices`, `env_served`,
`rejoin`, `describe`, `attach`, `TLS_ROLES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from pipelines.clusters.checks import check_address, check_cluster, inert_address
from pipelines.clusters.handle import ClusterHandle
from pipelines.clusters.tls import CLIENT_ROLES, security
from tasks.config import Config, register_family
from tasks.config.schema import ClusterConfig


@register_family("cluster", "address", checks=(check_cluster, check_address))
@dataclass(frozen=True)
class AddressClusterConfig(ClusterConfig):
    """`cluster` with `kind: address` (conf/cluster/address.yaml): the scheduler to connect to."""

    kind: str = "address"
    address: Optional[str] = None  # tcp://host:8786 (tls://host:8786 with cluster.security); required
    connect_timeout_s: float = 30.0  # the scheduler answers within this, else one-line error
    WORKERS_HERE: ClassVar[bool] = False  # the workers are the existing cluster's (on any machine)
    inert_keys = staticmethod(inert_address)  # value-dependent keys that do nothing (tasks.config.checks.inert)


TLS_ROLES = CLIENT_ROLES  # the scheduler's and workers' keys are the existing processes' own business


def check_machine(cfg: Config, cuda_count: int) -> None:
    """Nothing to check on this machine: the workers are elsewhere."""


def devices(cfg: Config, cuda_count: int) -> tuple[None, str]:
    """Unknown before connecting (with `cluster.num_gpus` null): the GPU workers are counted by `plan_placement`."""
    return None, ""


def env_served(cfg: Config, n: int) -> None:
    """Unknown before connecting: which env worker serves which device follows the live workers' hosts."""
    return None


def rejoin(cfg: Config) -> tuple[int, float]:
    """(workers to wait for after a restart, seconds): one, within max(120 s, `cluster.connect_timeout_s`)."""
    return 1, max(120.0, cfg.cluster.connect_timeout_s)


def describe(cfg: Config, num_devices: int | None) -> str:
    """One line for `pipelines.validate`: the scheduler's address."""
    return str(cfg.cluster.address)


def connect(address: str, timeout_s: float, sec=None):
    """A Client for an existing scheduler, or ConnectionError (one line, with the fix) within `timeout_s`.
    `sec`: a distributed.Security for a tls:// scheduler (`security(cfg)`), else None.

    The deadline is enforced here: distributed's own `timeout` does not cover a peer that accepts the TCP
    connection but never answers the handshake (a wrong port), where `Client()` would wait forever.
    """
    import threading

    from distributed import Client
    fix = ("start it (`dask scheduler`, `docker compose up`), or run on the embedded local cluster "
           "(cluster.kind=local, the default)")
    box: dict = {}

    def attempt():  # in a daemon thread, so a hung handshake cannot keep the process alive
        try:
            box["client"] = Client(address, timeout=timeout_s, security=sec)
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


def attach(cfg: Config):
    """A Client of the scheduler at `cluster.address` (`connect`), e.g. for `pipelines.validate --connect`."""
    return connect(cfg.cluster.address, cfg.cluster.connect_timeout_s, security(cfg))


def start(cfg: Config) -> ClusterHandle:
    """Connect to `cluster.address` (`connect`). Raises ConnectionError (one line: the address and the fix)."""
    client = attach(cfg)
    return ClusterHandle(client, None, client.dashboard_link)
