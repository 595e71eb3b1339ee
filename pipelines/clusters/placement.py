"""Placement (RLinf's `cluster.component_placement`): components on devices, and nodes on live workers.

The components `actor`, `env`, `rollout` map to device indices, device i being the i-th GPU worker (natural order
of worker names: gpu-2 before gpu-10). Each env worker serves one device (round-robin over the GPU workers of its
host, or of the whole cluster when its host has none); an env placed on devices D runs its shards round-robin on
the env workers serving D. The mode follows from the device sets: colocated (all equal), disaggregated (pairwise
disjoint), hybrid (anything else). Every check runs before a task is submitted, so no task can wait forever in
`no-worker`: offline (`check_placement`, against the devices the cluster kind implies: `kind.devices`) and on the
live workers (`plan_placement`).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from pipelines.clusters.errors import PlacementError
from pipelines.clusters.info import cluster_info
from pipelines.clusters.resources import RESOURCES, check_resources
from tasks.config import Config, ConfigError
from tasks.config.schema import ClusterConfig

COMPONENTS = ClusterConfig.COMPONENTS  # ("actor", "env", "rollout"): what cluster.component_placement places
SPEC_FORMS = "'all', 'N', 'A-B', 'A,B' or 'A-B,C' (device indices from 0)"


@dataclass(frozen=True)
class ComponentPlacement:
    """`cluster.component_placement` parsed against a number of devices.

    devices: component -> sorted device indices, every component present (left-out or empty ones get the
    defaults: actor on device 0, rollout with the actor, env on all devices). mode: colocated | disaggregated |
    hybrid.
    """

    devices: dict[str, tuple[int, ...]]
    num_devices: int
    mode: str

    def describe(self) -> str:
        return (f"{self.mode}: " + ", ".join(f"{c} {_ranges(self.devices[c])}" for c in COMPONENTS)
                + f" (of {self.num_devices} GPU{'s' if self.num_devices != 1 else ''})")


@dataclass
class Placement:
    """Worker addresses per component: env shard s -> env worker (eval shard s -> same), actor -> GPU worker.

    `actor_workers` / `rollout_workers` hold one GPU worker per device of the component (`actor_worker` and
    `rollout_worker` are their first); `annotations(component, i)` gives the Dask annotations of its nodes.
    """

    shard_workers: list[str]
    actor_worker: str
    env_workers: list[str] = field(default_factory=list)
    gpu_workers: list[str] = field(default_factory=list)
    rollout_worker: str = ""  # "": the actor's worker
    actor_workers: list[str] = field(default_factory=list)
    rollout_workers: list[str] = field(default_factory=list)
    devices: dict[str, tuple[int, ...]] = field(default_factory=dict)
    mode: str = "colocated"

    def __post_init__(self):
        self.actor_workers = self.actor_workers or [self.actor_worker]
        self.rollout_worker = self.rollout_worker or (self.rollout_workers or [self.actor_worker])[0]
        self.rollout_workers = self.rollout_workers or [self.rollout_worker]

    def annotations(self, component: str, index: int = 0) -> dict:
        """Annotations of node `index` of `component` (env: shard; actor: rank; rollout: inference group),
        pinned to its worker, with the resource the component needs."""
        pools = {"env": self.shard_workers, "actor": self.actor_workers, "rollout": self.rollout_workers}
        if component not in pools:
            raise KeyError(f"unknown component {component!r}; known: {list(COMPONENTS)}")
        ws = pools[component]
        return {"workers": [ws[index % len(ws)]], "allow_other_workers": False,
                "resources": dict(RESOURCES[component])}

    def node_annotations(self) -> list[tuple[str, dict]]:
        """(node label, annotations) for every placed node: env shards, actor ranks, rollout groups."""
        return ([(f"env_s{s}", self.annotations("env", s)) for s in range(len(self.shard_workers))]
                + [(f"actor_r{r}", self.annotations("actor", r)) for r in range(len(self.actor_workers))]
                + [(f"rollout_g{g}", self.annotations("rollout", g)) for g in range(len(self.rollout_workers))])


# ----- cluster.component_placement: parsing and the numbers of devices -----

def parse_devices(key: str, spec, num_devices: int | None, source: str = "") -> tuple[int, ...] | None:
    """One placement value -> sorted device indices (None for "all" while `num_devices` is unknown).

    Forms: "all", "N", "A-B", "A,B", "A-B,C". Raises ConfigError naming `key`, the value and the numbers: a
    malformed part, a backwards range, a device listed twice (overlapping ranges), an index >= `num_devices`.
    """
    text = str(spec).strip()
    if text.lower() == "all":
        return None if num_devices is None else tuple(range(num_devices))
    seen: dict[int, str] = {}
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", part)
        if not m:
            raise ConfigError(key, spec, f"{part!r} is not a device index or range; use {SPEC_FORMS}")
        a = int(m.group(1))
        b = a if m.group(2) is None else int(m.group(2))
        if b < a:
            raise ConfigError(key, spec, f"range {a}-{b} runs backwards; write {b}-{a}")
        for d in range(a, b + 1):
            if d in seen:
                raise ConfigError(key, spec, f"device {d} is listed twice ({seen[d]!r} and {part!r} overlap)")
            seen[d] = part
    devices = tuple(sorted(seen))
    if num_devices is not None and devices[-1] >= num_devices:
        raise ConfigError(key, spec, f"needs {devices[-1] + 1} GPUs, the cluster has {num_devices}"
                                     f"{f' ({source})' if source else ''}; use devices "
                                     f"{_ranges(tuple(range(num_devices)))} or 'all', or a cluster with more GPUs")
    return devices


def _entries(spec: dict) -> dict[str, tuple[str, str]]:
    """component -> (config key, value) of the non-empty entries. Raises ConfigError: unknown or doubly placed."""
    out: dict[str, tuple[str, str]] = {}
    for names, value in spec.items():
        if value is None or str(value).strip() == "":
            continue
        key = f"cluster.component_placement.{names}"
        for name in (n.strip() for n in str(names).split(",")):
            if name not in COMPONENTS:
                raise ConfigError(key, value, f"unknown component {name!r}; known: {list(COMPONENTS)}")
            if name in out:
                raise ConfigError(key, value, f"component {name!r} is placed twice (also by {out[name][0]})")
            out[name] = (key, value)
    return out


def placement_mode(devices: dict[str, tuple[int, ...]]) -> str:
    """colocated: every component on the same devices; disaggregated: pairwise disjoint; hybrid: otherwise."""
    sets = [set(d) for d in devices.values()]
    if all(s == sets[0] for s in sets):
        return "colocated"
    if all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1:]):
        return "disaggregated"
    return "hybrid"


def parse_component_placement(spec: dict, num_devices: int, source: str = "") -> ComponentPlacement:
    """`cluster.component_placement` -> ComponentPlacement on `num_devices` devices. Raises ConfigError.

    `source` says where `num_devices` comes from; it is quoted in the too-few-devices error.
    """
    devices = {c: parse_devices(k, v, num_devices, source) for c, (k, v) in _entries(spec).items()}
    devices.setdefault("actor", (0,))
    devices.setdefault("rollout", devices["actor"])
    devices.setdefault("env", tuple(range(num_devices)))
    devices = {c: devices[c] for c in COMPONENTS}
    return ComponentPlacement(devices, num_devices, placement_mode(devices))


def _ranges(devs: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'"""
    out, i = [], 0
    while i < len(devs):
        j = i
        while j + 1 < len(devs) and devs[j + 1] == devs[j] + 1:
            j += 1
        out.append(str(devs[i]) if i == j else f"{devs[i]}-{devs[j]}")
        i = j + 1
    return ",".join(out)


def _cuda_device_count() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch or no driver: a CPU-only machine
        return 0


def num_devices(cfg: Config, cuda_count: int | None = None) -> tuple[int | None, str]:
    """(number of devices, where it comes from) of the cluster `cfg` describes, without starting it.

    `cluster.num_gpus` when set; else what the kind knows offline (`devices` of pipelines/clusters/<kind>.py: the
    embedded cluster's CUDA devices or, on CPU-only machines, its `num_gpu_workers` logical ones); else (an
    existing cluster) None: known once connected (`plan_placement`).
    """
    from pipelines.clusters.kinds import kind_of
    c = cfg.cluster
    if c.num_gpus is not None:
        return c.num_gpus, f"cluster.num_gpus={c.num_gpus}"
    return kind_of(cfg).devices(cfg, _cuda_device_count() if cuda_count is None else cuda_count)


def check_placement(cfg: Config, cuda_count: int | None = None, command: str = "run") -> ComponentPlacement | None:
    """Offline: parse `cluster.component_placement` against the devices the config implies (`num_devices`), and
    refuse placement entries that would do nothing (`check_placement_effect`; `command`: "run" or "record").

    Returns None for an existing cluster of unknown size (`cluster.num_gpus` null): then only the syntax is checked
    here and the numbers by `plan_placement` once connected. Raises ConfigError with the numbers; PlacementError
    for what the kind's machine cannot hold (`check_machine` of the kind: `cluster.num_gpus` above this machine's
    CUDA devices for the embedded cluster).
    """
    from pipelines.clusters.kinds import kind_of
    kind = kind_of(cfg)
    cuda = _cuda_device_count() if cuda_count is None else cuda_count
    kind.check_machine(cfg, cuda)
    c = cfg.cluster
    n, source = num_devices(cfg, cuda)
    if n is None:
        devices = {comp: parse_devices(k, v, None) for comp, (k, v) in _entries(c.component_placement).items()}
        check_placement_effect(cfg, devices, command)
        return None
    cp = parse_component_placement(c.component_placement, n, source)
    check_actor_ranks(cfg, cp, source)
    served = kind.env_served(cfg, n)  # the devices the env workers serve, when the kind knows them offline
    if served is not None:
        _check_env_served(c.component_placement, cp, served)
    check_placement_effect(cfg, cp.devices, command)
    return cp


def check_placement_effect(cfg: Config, devices: dict[str, tuple[int, ...] | None], command: str = "run") -> None:
    """Refuse a `cluster.component_placement` entry that would do nothing. Only entries given (non-empty) count;
    `devices`: component -> device indices (None: "all" on a cluster of unknown size).

    * actor on more devices than `algorithm.num_actor_ranks` (rank r runs on the actor's r-th device: the others
      would idle);
    * rollout with `rollout.inference=colocated`: inference runs inside the env_step nodes on the env workers, so
      rollout must be placed with env (in the same entry, e.g. {"actor,env,rollout": all}, or on the same devices
      as a given env entry); set `rollout.inference=disaggregated` for policy_infer nodes on rollout's devices;
    * rollout with `rollout.inference=disaggregated` on more devices than `rollout.pipeline_stage_num` (stage j's
      policy_infer nodes run on rollout device j mod n; more devices than stages would idle);
    * actor or rollout for `pipelines.record` (the teacher runs inside the env shards' record nodes), rollout for an
      algorithm that rolls nothing out (`algorithm.spec.rollout` false: sft), unless given in one entry with env.

    Raises:
        PlacementError: naming the entry's key, its value, why and the fix.
    """
    entries = _entries(cfg.cluster.component_placement)

    def with_env(comp: str) -> bool:
        return "env" in (n.strip() for n in entries[comp][0].rsplit(".", 1)[-1].split(","))

    def refuse(comp: str, why: str):
        key, value = entries[comp]
        raise PlacementError(key, value, why)

    a, r = cfg.algorithm, cfg.rollout
    if command == "record":
        for comp in ("actor", "rollout"):
            if comp in entries and not with_env(comp):
                refuse(comp, "pipelines.record runs the teacher inside the env shards' record nodes (env workers): "
                             f"a {comp} placement does nothing there; drop it")
        return
    if "actor" in entries and devices.get("actor") is not None and len(devices["actor"]) > a.num_actor_ranks:
        n = len(devices["actor"])
        refuse("actor", f"places the actor on {n} devices, algorithm.num_actor_ranks={a.num_actor_ranks} uses "
                        f"{a.num_actor_ranks} (rank r on the r-th): set algorithm.num_actor_ranks={n} or place the "
                        f"actor on {a.num_actor_ranks} device{'s' if a.num_actor_ranks != 1 else ''}")
    if "rollout" not in entries or with_env("rollout"):
        return
    if not a.spec.rollout:
        refuse("rollout", f"algorithm.name={a.name} rolls nothing out: drop the rollout placement")
    if r.inference == "colocated":
        if "env" in entries and devices.get("env") == devices.get("rollout"):
            return
        refuse("rollout", "with rollout.inference=colocated inference runs inside the env_step nodes on the env "
                          "workers, so a rollout placement apart from env does nothing: set "
                          "rollout.inference=disaggregated (policy_infer nodes on rollout's devices) or place rollout "
                          "with env ('+cluster.component_placement={env\\,rollout: all}')")
    p, devs = r.pipeline_stage_num, devices.get("rollout")
    if devs is not None and len(devs) > p:
        refuse("rollout", f"places rollout on {len(devs)} devices; with rollout.pipeline_stage_num={p} the "
                          f"policy_infer nodes of stage j run on rollout device j mod {len(devs)}, so "
                          f"{len(devs) - p} would idle: place rollout on <= {p} devices or set "
                          f"rollout.pipeline_stage_num={len(devs)} (or a multiple)")


def check_actor_ranks(cfg: Config, cp: ComponentPlacement, source: str = "") -> None:
    """Raise PlacementError unless `algorithm.num_actor_ranks` <= the actor's devices (one GPU worker per rank:
    two ranks in one worker process would deadlock in their first collective)."""
    R, devs = cfg.algorithm.num_actor_ranks, cp.devices["actor"]
    if R <= len(devs):
        return
    spec = _entries(cfg.cluster.component_placement).get("actor", ("", "0 (default)"))[1]
    fix = (f"place the actor on {R} devices (cluster.component_placement.actor=0-{R - 1})"
           if R <= cp.num_devices else f"use a cluster with >= {R} GPU workers (cluster.num_gpu_workers={R} on CPU)"
                                      f" and cluster.component_placement.actor=0-{R - 1}")
    raise PlacementError("algorithm.num_actor_ranks", R,
                         f"needs {R} actor devices (one GPU worker per rank), cluster.component_placement.actor="
                         f"{spec} gives {len(devs)} of the {cp.num_devices} GPU"
                         f"{'s' if cp.num_devices != 1 else ''}{f' ({source})' if source else ''}; {fix}, "
                         f"or lower algorithm.num_actor_ranks")


def _check_env_served(spec: dict, cp: ComponentPlacement, served: list[int]) -> None:
    """Raise PlacementError unless some env worker serves one of the env's devices (`served`: one per worker)."""
    if set(served) & set(cp.devices["env"]):
        return
    key, value = _entries(spec).get("env", ("cluster.component_placement.env", "all"))
    raise PlacementError(key, value, f"no env (CPU) worker serves devices {_ranges(cp.devices['env'])}: the "
                                     f"{len(served)} env workers serve devices {_ranges(tuple(sorted(set(served))))}"
                                     f"; add env workers (one per device: cluster.num_env_workers="
                                     f"{cp.num_devices}) or place env on those devices")


# ----- placement on live workers -----

def natural_order(name) -> list:
    """Sort key: gpu-2 before gpu-10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(name))]


def host_of(address: str) -> str:
    """'tcp://10.0.0.5:40001' -> '10.0.0.5' (the host part of a worker's address)."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def _env_devices(env_w: list[str], gpu_w: list[str]) -> dict[str, int]:
    """env worker -> the device it serves: round-robin over the GPU workers on its host (all devices when its
    host has none, as on a one-host cluster where every worker is 127.0.0.1)."""
    by_host: dict[str, list[int]] = {}
    for d, g in enumerate(gpu_w):
        by_host.setdefault(host_of(g), []).append(d)
    seen: Counter = Counter()
    out = {}
    for w in env_w:
        h = host_of(w) if host_of(w) in by_host else None
        devs = by_host[h] if h is not None else list(range(len(gpu_w)))
        out[w] = devs[seen[h] % len(devs)]
        seen[h] += 1
    return out


def plan_placement(cfg: Config, client) -> Placement:
    """Map components to the live workers: GPU worker i is device i; the actor and rollout get the GPU workers of
    their devices; env shards go round-robin over the env (`CPU`) workers serving the env's devices.

    Args:
        client: a distributed Client, or its `scheduler_info()` dict (tests need no cluster).
    Raises:
        PlacementError (a ConfigError) with the numbers, before anything is submitted: no worker with a resource
        a component needs, `cluster.num_gpus` or a placement's device index above the GPU workers, env devices
        that no env worker serves (any of which would leave a task waiting forever in `no-worker`).
    """
    info = cluster_info(client)
    workers = info["workers"]
    by_name = sorted(workers.items(), key=lambda kv: (natural_order(kv[1].get("name", kv[0])), kv[0]))
    env_w = [a for a, w in by_name if w.get("resources", {}).get("CPU", 0) >= 1]
    gpu_w = [a for a, w in by_name if w.get("resources", {}).get("GPU", 0) >= 1]
    if not env_w:
        raise PlacementError("cluster", f"{len(workers)} workers, none with resource CPU",
                             "env shards need workers started with `--resources CPU=1`")
    if not gpu_w:
        raise PlacementError("cluster", f"{len(workers)} workers, none with resource GPU",
                             "the actor needs a worker started with `--resources GPU=1` (logical on CPU machines)")
    c = cfg.cluster
    if c.num_gpus is not None and c.num_gpus > len(gpu_w):
        raise PlacementError("cluster.num_gpus", c.num_gpus,
                             f"the cluster has {len(gpu_w)} GPU workers (resource GPU) among {len(workers)} "
                             f"workers; start more or lower cluster.num_gpus")
    gpu_w = gpu_w[:c.num_gpus] if c.num_gpus is not None else gpu_w
    source = f"{len(gpu_w)} GPU worker{'s' if len(gpu_w) != 1 else ''} in the cluster"
    try:
        cp = parse_component_placement(c.component_placement, len(gpu_w), source)
    except ConfigError as exc:  # the live cluster cannot hold it
        raise PlacementError(exc.key, exc.value, exc.fix) from None
    check_actor_ranks(cfg, cp, source)
    serves = _env_devices(env_w, gpu_w)
    _check_env_served(c.component_placement, cp, list(serves.values()))
    pool = [w for w in env_w if serves[w] in cp.devices["env"]]
    actor = [gpu_w[d] for d in cp.devices["actor"]]
    rollout = [gpu_w[d] for d in cp.devices["rollout"]]
    placement = Placement(shard_workers=[pool[s % len(pool)] for s in range(cfg.env.num_shards)],
                          actor_worker=actor[0], env_workers=env_w, gpu_workers=gpu_w, rollout_worker=rollout[0],
                          actor_workers=actor, rollout_workers=rollout, devices=cp.devices, mode=cp.mode)
    check_resources(placement.node_annotations(), workers)
    return placement

