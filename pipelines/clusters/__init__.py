"""The Dask cluster: one kind a file, selected by `cluster.kind`, and what every kind shares.

Kinds (pipelines/clusters/<kind>.py, each registered with `tasks.config.registry` by its config class):
  local.py    the embedded local cluster this driver starts (the default; conf/cluster/local.yaml)
  address.py  an existing scheduler at `cluster.address` (conf/cluster/address.yaml; docker-compose.yml)
  slurm.py    Slurm batch jobs this driver submits (conf/cluster/slurm.yaml), through jobqueue.py (dask-jobqueue)
  pbs.py, lsf.py, sge.py  PBS, LSF and Grid Engine batch jobs (conf/cluster/<kind>.yaml): each kind's module is its
              config class, its `batch.BatchSystem` (directive spellings, queue listing) and its queue parse;
              batch.py builds the jobs, scripts, checks and start of every batch kind from that description
  kubernetes.py  a DaskCluster of the Dask operator this driver creates (conf/cluster/kubernetes.yaml; deploy/), its
              resources built in kubernetes_spec.py
Shared: placement.py (`cluster.component_placement`: parsing, offline checks, planning on live workers),
resources.py (what each component's nodes need, checked against the workers), tls.py (Dask TLS),
info.py (the scheduler's view of its workers), handle.py (the started cluster's handle, the embedded scheduler's
dask config), checks.py (the kinds' rules).

A kind's module provides the `ClusterKind` interface below; `start_cluster(cfg)` calls the selected kind's
`start`. Adding a kind (Slurm, Kubernetes, ...) is one module here plus its line in
`tasks.config.registry.MODULES` (and a conf/cluster/<kind>.yaml): nothing outside asks which kind it is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipelines.clusters.errors import PlacementError  # noqa: F401
from pipelines.clusters.handle import ClusterHandle, scheduler_config, scheduler_http_routes  # noqa: F401
from pipelines.clusters.kinds import ClusterKind, kind_of  # noqa: F401
from pipelines.clusters.info import (cluster_info, cluster_rss_bytes, pause_fraction, wait_for_workers,  # noqa: F401
                                     worker_health)
from pipelines.clusters.placement import (COMPONENTS, ComponentPlacement, Placement, check_placement,  # noqa: F401
                                          check_placement_effect, host_of, natural_order, num_devices,
                                          parse_component_placement, parse_devices, plan_placement)
from pipelines.clusters.resources import RESOURCES, check_graph, check_resources  # noqa: F401
from pipelines.clusters.tls import security  # noqa: F401

if TYPE_CHECKING:
    from tasks.config import Config


def start_cluster(cfg: Config) -> ClusterHandle:
    """Start the cluster `cluster.kind` selects (the embedded local cluster, or a connection to an existing
    scheduler) with the driver's console quietened, and install the worker-resident registry (tasks.resident).

    Raises:
        ConnectionError: the cluster did not start or the scheduler did not answer (one line, with the fix).
        PlacementError (a ConfigError) before any worker starts: more GPUs asked for than the machine or the
        config provides.
    """
    from pipelines.clusters.handle import quiet_driver_logs
    from tasks import resident
    quiet_driver_logs()
    handle = kind_of(cfg).start(cfg)
    resident.install(handle.client)  # worker-resident objects live in a worker plugin (tasks.resident)
    return handle


def rejoin(cfg: Config) -> tuple[int, float]:
    """(workers the whole cluster has, seconds to wait for them after a restart) of the selected kind."""
    return kind_of(cfg).rejoin(cfg)


def describe_cluster(cfg: Config, num_devices: int | None = None) -> str:
    """One line naming the selected cluster (`num_devices`: the GPU workers when known)."""
    return kind_of(cfg).describe(cfg, num_devices)


def attach(cfg: Config):
    """A distributed Client of the selected kind's running scheduler, starting nothing. Raises ConfigError (the
    kind has no cluster before it starts one) or ConnectionError (one line, the address and the fix)."""
    return kind_of(cfg).attach(cfg)
