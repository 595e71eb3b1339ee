"""Cluster kinds (`cluster.kind`): one module a kind behind one interface (pipelines/clusters/<kind>.py), selected
by name through the family registry; a key a kind lacks is unknown for it; an experiment's keys of the kind the
command line left are dropped with a note. No cluster is started here (the kinds' starts are covered by
test_placement.py and test_cluster_security.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest

import pipelines.clusters as pc
from pipelines.config import load_config
from tasks.config import Config, ConfigError, families, family_class, register_family, replace_key, replace_keys
from tasks.config.schema import ClusterConfig

INTERFACE = ("start", "check_machine", "devices", "env_served", "rejoin", "describe", "attach")


@pytest.mark.parametrize("kind", ["local", "address", "slurm", "pbs", "lsf", "sge", "kubernetes"])
def test_every_kind_is_one_module_with_the_interface(kind):
    """The kind's config class subclasses the shared base (the keys every kind has) and selects itself by its
    `kind`; its module (where the class lives) provides every function of `pipelines.clusters.ClusterKind`."""
    cls = family_class("cluster", kind)
    assert issubclass(cls, ClusterConfig) and cls().kind == kind
    base = {f.name for f in dataclasses.fields(ClusterConfig)}
    assert base <= {f.name for f in dataclasses.fields(cls)}
    cfg = Config(cluster=cls())
    module = pc.kind_of(cfg)
    assert module.__name__ == f"pipelines.clusters.{kind}"
    assert all(callable(getattr(module, name)) for name in INTERFACE), [n for n in INTERFACE
                                                                       if not hasattr(module, n)]
    assert set(module.TLS_ROLES) <= {f.name for f in dataclasses.fields(cls().security)}


def test_each_kind_has_its_own_keys_only():
    """The embedded cluster's process keys are the local kind's, the scheduler's address the address kind's."""
    local = {f.name for f in dataclasses.fields(family_class("cluster", "local"))}
    address = {f.name for f in dataclasses.fields(family_class("cluster", "address"))}
    assert {"host", "num_env_workers", "num_gpu_workers", "actor_threads", "dashboard_address",
            "start_timeout_s"} <= local - address
    assert {"address", "connect_timeout_s"} <= address - local


def test_what_each_kind_knows_before_it_starts():
    """Offline: the local kind counts this machine's devices (CUDA, else its logical GPU workers) and which device
    each env worker serves (j mod n); an existing cluster's are known once connected."""
    local = replace_keys(Config(), {"cluster.num_env_workers": 3, "cluster.num_gpu_workers": 2})
    kind = pc.kind_of(local)
    assert kind.devices(local, 0) == (2, "cluster.num_gpu_workers=2, no CUDA device")
    assert kind.devices(local, 4)[0] == 4
    assert kind.env_served(local, 2) == [0, 1, 0]
    assert kind.rejoin(local) == (3 + 2, 120.0)  # every worker it started, within 120 s
    assert pc.describe_cluster(local, 2) == "local, 3 env workers (CPU) + 2 GPU workers"
    remote = Config(cluster=family_class("cluster", "address")(address="tcp://10.0.0.1:8786", connect_timeout_s=200))
    kind = pc.kind_of(remote)
    assert kind.devices(remote, 4) == (None, "") and kind.env_served(remote, 4) is None
    assert kind.rejoin(remote) == (1, 200.0)
    assert pc.describe_cluster(remote) == "tcp://10.0.0.1:8786"
    assert pc.num_devices(remote, 4) == (None, "")
    remote = replace_key(remote, "cluster.num_gpus", 3)
    assert pc.num_devices(remote, 4) == (3, "cluster.num_gpus=3")
    assert (remote.cluster.env_workers, local.cluster.env_workers) == (None, 3)


def test_the_embedded_cluster_has_nothing_to_attach_to():
    with pytest.raises(ConfigError, match=r"^cluster\.address=None: --connect checks an existing cluster"):
        pc.attach(Config())


def test_an_address_alone_names_the_kind_to_set():
    """`cluster.address=...` without the kind: one line that says to choose the address kind (cluster=address)."""
    with pytest.raises(ConfigError) as err:
        load_config(["cluster.address=tcp://10.0.0.1:8786"], components=False, notes=[])
    msg = str(err.value)
    assert err.value.key == "cluster.address" and "\n" not in msg
    assert msg.endswith("choose a preset of that family (cluster=address)"), msg


@pytest.mark.parametrize("overrides, key", [
    (["cluster=address", "cluster.address=tcp://10.0.0.1:8786", "cluster.num_env_workers=3"],
     "cluster.num_env_workers"),
    (["cluster.kind=address", "cluster.address=tcp://10.0.0.1:8786", "cluster.dashboard_address=:0"],
     "cluster.dashboard_address"),
    (["cluster.connect_timeout_s=5"], "cluster.connect_timeout_s"),  # the local kind connects to nothing
])
def test_a_key_the_kind_lacks_is_unknown_for_it(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(overrides, components=False, notes=[])
    kind = "local" if "cluster.kind=address" not in overrides and "cluster=address" not in overrides else "address"
    assert err.value.key == key and f"unknown key for cluster.kind={kind}" in str(err.value), err.value


def test_the_experiments_keys_of_the_kind_left_are_dropped_with_a_note():
    """conf=smoke sets the local kind's `dashboard_address` (its file) and chooses conf/cluster/local.yaml
    (`num_env_workers`): with the address kind chosen on the command line each is dropped with one note, and the
    config holds the address kind's keys only."""
    notes: list[str] = []
    cfg, _ = load_config(["conf=smoke", "cluster.kind=address", "cluster.address=tcp://10.0.0.1:8786"],
                         components=False, notes=notes)
    assert type(cfg.cluster) is family_class("cluster", "address") and cfg.cluster.address == "tcp://10.0.0.1:8786"
    assert not hasattr(cfg.cluster, "dashboard_address") and not hasattr(cfg.cluster, "num_env_workers")
    dropped = sorted(n.split("=", 1)[0].removeprefix("note: ") for n in notes)
    assert dropped == ["cluster.dashboard_address", "cluster.num_env_workers"], notes
    assert all("it is a key of cluster.kind=local" in n for n in notes), notes
    # without the command line choosing the kind nothing is dropped
    notes.clear()
    cfg, _ = load_config(["conf=smoke"], components=False, notes=notes)
    assert cfg.cluster.dashboard_address == "127.0.0.1:0" and notes == []


# ----- a new kind is one module: this test module is one (its class, its functions), plus one registry line -----

FAKE = "fake_kind_of_test_clusters"
STARTED: list[str] = []


@dataclass(frozen=True)
class FakeClusterConfig(ClusterConfig):
    """A kind with three GPU workers and one env worker per device, known offline."""

    kind: str = FAKE
    devices_here: int = 3
    WORKERS_HERE: ClassVar[bool] = False


TLS_ROLES = ("tls_ca_file",)


def check_machine(cfg, cuda_count):
    pass


def devices(cfg, cuda_count):
    return cfg.cluster.devices_here, f"{cfg.cluster.devices_here} fake devices"


def env_served(cfg, n):
    return list(range(n))


def rejoin(cfg):
    return cfg.cluster.devices_here, 1.0


def describe(cfg, num_devices):
    return f"fake, {num_devices} devices"


def attach(cfg):
    raise ConfigError("cluster.kind", FAKE, "nothing to attach to")


class _Client:
    dashboard_link = ""

    def register_plugin(self, plugin, name):  # tasks.resident.install
        STARTED.append(name)


def start(cfg):
    STARTED.append("start")
    return pc.ClusterHandle(_Client(), None, "")


@pytest.fixture
def fake_kind(monkeypatch):
    """The fake kind registered for one test (its `register_family` line, undone after)."""
    from tasks.config import registry
    for table in (registry._CLASSES["cluster"], registry._CHECKS["cluster"]):
        monkeypatch.setitem(table, FAKE, None)  # restored (removed) after the test
    register_family("cluster", FAKE, checks=(lambda cfg: STARTED.append("checked"),))(FakeClusterConfig)
    yield FakeClusterConfig
    STARTED.clear()


def test_a_new_kind_needs_no_edit_outside_its_module(fake_kind):
    """start_cluster, the offline placement check and the registry's checks reach a kind that lives in one module
    (here: this test module) through its registered class: no branch on the kind's name anywhere."""
    assert families("cluster")[FAKE] is fake_kind
    cfg = Config(cluster=fake_kind())
    cfg.cluster.component_placement.update({"actor": "2", "env": "0-1"})
    cp = pc.check_placement(cfg, cuda_count=0)  # 3 devices from the kind, env workers serving 0, 1, 2
    # rollout with the actor (2), env apart (0-1): neither all equal nor pairwise disjoint
    assert cp.num_devices == 3 and cp.devices == {"actor": (2,), "env": (0, 1), "rollout": (2,)}
    assert cp.mode == "hybrid"
    cfg.cluster.component_placement.update({"actor": "3"})
    with pytest.raises(ConfigError, match=r"needs 4 GPUs, the cluster has 3 \(3 fake devices\)"):
        pc.check_placement(cfg, cuda_count=0)
    handle = pc.start_cluster(Config(cluster=fake_kind()))
    assert STARTED[:1] == ["start"] and len(STARTED) == 2  # started, then the resident plugin installed
    assert pc.rejoin(Config(cluster=fake_kind())) == (3, 1.0) and handle.cluster is None
    from tasks.config import check_config
    STARTED.clear()
    check_config(Config(cluster=fake_kind()))
    assert STARTED == ["checked"]  # the rules registered with the kind ran
