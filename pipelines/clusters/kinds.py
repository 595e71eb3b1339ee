"""The interface of a cluster kind (one module a kind: pipelines/clusters/<kind>.py) and the lookup of the kind a
config selects (`cluster.kind`, through the family registry). Imports nothing of pipelines/clusters, so every module
of the package may ask `kind_of` without an import cycle."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pipelines.clusters.handle import ClusterHandle
    from tasks.config import Config


class ClusterKind(Protocol):
    """What a kind's module (pipelines/clusters/<kind>.py) provides, besides its registered config class."""

    TLS_ROLES: tuple[str, ...]  # the cluster.security files the kind hands to distributed.Security

    def start(self, cfg: Config) -> ClusterHandle:
        """Start or connect the cluster; raise ConnectionError (one line, the key and the fix) or ConfigError."""

    def check_machine(self, cfg: Config, cuda_count: int) -> None:
        """Offline: raise PlacementError when this machine cannot hold what the config asks of it."""

    def devices(self, cfg: Config, cuda_count: int) -> tuple[int | None, str]:
        """Offline, with `cluster.num_gpus` null: (devices, where the number comes from), None when unknown."""

    def env_served(self, cfg: Config, n: int) -> list[int] | None:
        """Offline: the device each env worker serves (one entry per env worker), None when unknown."""

    def rejoin(self, cfg: Config) -> tuple[int, float]:
        """(workers the whole cluster has, seconds to wait for them after a restart): the driver's watch."""

    def describe(self, cfg: Config, num_devices: int | None) -> str:
        """One line naming the cluster (pipelines.validate)."""

    def attach(self, cfg: Config):
        """A distributed Client of the kind's running scheduler without starting anything (`pipelines.validate
        --connect`); ConfigError (one line) for a kind whose cluster exists only once started."""


def kind_of(cfg: Config) -> ClusterKind:
    """The module of the cluster kind `cfg.cluster.kind` selects (the module its registered config class lives
    in). Raises ConfigError (cluster.kind) for an unknown kind, listing the known ones."""
    from tasks.config import family_class
    return importlib.import_module(family_class("cluster", cfg.cluster.kind).__module__)
