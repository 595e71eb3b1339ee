"""The Dask cluster: an embedded local cluster of worker processes, or an existing scheduler; and placement.

Local cluster (default): a scheduler and workers bound to `cluster.host` and a dashboard on
`cluster.dashboard_address` (both 127.0.0.1 unless configured), `num_env_workers` processes named `env-i`
with resource `CPU=1` that host env shards, and one process `gpu-i` with resource `GPU=1` per device for the actor
and inference: on a machine with N CUDA devices one per device (`cluster.num_gpus` of them, all N when null) with
`CUDA_VISIBLE_DEVICES=i`; on CPU-only machines `cluster.num_gpus` (when set) or `num_gpu_workers` logical ones.
Remote (`cluster.address=tcp://host:8786`): workers must have been started with `--resources CPU=1` or
`--resources GPU=1` (docker-compose.yml shows how); resources are checked before anything is submitted.
TLS: `cluster.security` -> `distributed.Security` for the client and the embedded cluster (`security`).

Placement (RLinf's `cluster.component_placement`): the components `actor`, `env`, `rollout` map to device indices,
device i being the i-th GPU worker (natural order of worker names: gpu-2 before gpu-10). Each env worker serves
one device (round-robin over the GPU workers of its host, or of the whole cluster when its host has none); an env
placed on devices D runs its shards round-robin on the env workers serving D. The mode follows from the device
sets: colocated (all equal), disaggregated (pairwise disjoint), hybrid (anything else). Every check runs before a
task is submitted, so no task can wait forever in `no-worker`.
"""
from __future__ import annotations

import logging
import os
import re
from collections import Counter
from dataclasses import dataclass, field

from tasks import resident
from tasks.config import ClusterConfig, Config, ConfigError

COMPONENTS = ClusterConfig.COMPONENTS  # ("actor", "env", "rollout")
RESOURCES = {"env": {"CPU": 1}, "rollout": {"GPU": 1}, "actor": {"GPU": 1}}  # what one node of each needs
SPEC_FORMS = "'all', 'N', 'A-B', 'A,B' or 'A-B,C' (device indices from 0)"


class PlacementError(ConfigError):
    """The cluster cannot run the placement the config asks for."""


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

    `cluster.num_gpus` when set; else, for the embedded cluster, the CUDA devices or, on CPU-only machines, the
    `num_gpu_workers` logical ones; else (a remote cluster) None: known once connected (`plan_placement`).
    """
    c = cfg.cluster
    if c.num_gpus is not None:
        return c.num_gpus, f"cluster.num_gpus={c.num_gpus}"
    if c.address:
        return None, ""
    n = _cuda_device_count() if cuda_count is None else cuda_count
    if n:
        return n, f"{n} CUDA device{'s' if n != 1 else ''}"
    return c.num_gpu_workers, f"cluster.num_gpu_workers={c.num_gpu_workers}, no CUDA device"


def check_placement(cfg: Config, cuda_count: int | None = None, command: str = "run") -> ComponentPlacement | None:
    """Offline: parse `cluster.component_placement` against the devices the config implies (`num_devices`), and
    refuse placement entries that would do nothing (`check_placement_effect`; `command`: "run" or "record").

    Returns None for a remote cluster of unknown size (`cluster.num_gpus` null): then only the syntax is checked
    here and the numbers by `plan_placement` once connected. Raises ConfigError with the numbers; PlacementError
    for `cluster.num_gpus` above the machine's CUDA devices (embedded cluster).
    """
    c = cfg.cluster
    if not c.address and c.num_gpus is not None:
        cuda = _cuda_device_count() if cuda_count is None else cuda_count
        if cuda and c.num_gpus > cuda:
            raise PlacementError("cluster.num_gpus", c.num_gpus, f"this machine has {cuda} CUDA device"
                                                                 f"{'s' if cuda != 1 else ''}; use at most {cuda}, "
                                                                 "or null for all of them")
    n, source = num_devices(cfg, cuda_count)
    if n is None:
        devices = {comp: parse_devices(k, v, None) for comp, (k, v) in _entries(c.component_placement).items()}
        check_placement_effect(cfg, devices, command)
        return None
    cp = parse_component_placement(c.component_placement, n, source)
    check_actor_ranks(cfg, cp, source)
    if not c.address:  # the embedded cluster: env worker j serves device j % n (`_env_devices` on one host)
        _check_env_served(c.component_placement, cp, [j % n for j in range(c.num_env_workers)])
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
    * actor or rollout for `pipelines.record` (the teacher runs inside the env shards' record nodes), rollout for
      `algorithm.name=sft` (no rollouts), unless given in one entry with env.

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
    if a.name == "sft":
        refuse("rollout", "algorithm.name=sft rolls nothing out: drop the rollout placement")
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


# ----- the cluster -----

@dataclass
class ClusterHandle:
    client: object
    cluster: object | None
    dashboard_link: str

    def close(self) -> None:
        """Close the client and, for the embedded cluster, its processes. On a starved machine a nanny may not
        stop its worker within distributed's few seconds; that is not an error of the run (the processes are
        killed anyway), so close timeouts are swallowed. Closing logs nothing: the run has said what it had to (an `error:` line
        stays the last line on stderr), so the driver's, the nannies' and the workers' distributed/tornado loggers
        are silenced first (heartbeats to a closing scheduler fail with tracebacks otherwise)."""
        _silence_close_logs(self.client if self.cluster is not None else None)
        try:
            self.client.close()
        except (TimeoutError, OSError):
            pass
        finally:
            if self.cluster is not None:
                try:
                    self.cluster.close(timeout=60)
                except (TimeoutError, OSError):
                    pass


_CLOSE_LOGGERS = ("distributed", "tornado", "tornado.application", "asyncio")  # distributed sets tornado.application
# to error itself, so the parent's level does not reach it


def _quiet_logs() -> None:
    """Set the loggers that report a cluster's shutdown to CRITICAL in this process."""
    import logging
    for name in _CLOSE_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _silence_close_logs(client, wait_s: float = 5.0) -> None:
    """`_quiet_logs` here and, with `client` (an embedded cluster's), on its workers and nannies, waiting at most
    `wait_s` (a paused or dying worker must not hold up the close)."""
    import threading
    _quiet_logs()
    if client is None:
        return

    def run() -> None:
        for nanny in (False, True):
            try:
                client.run(_quiet_logs, nanny=nanny, on_error="ignore")
            except Exception:  # noqa: BLE001 - best effort: a closing cluster may refuse
                pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(wait_s)


def _worker_env(cuda_device: int | None, simulator: str) -> dict[str, str]:
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if simulator == "maniskill":
        from tasks.envs.maniskill.vulkan import vulkan_env
        env.update(vulkan_env())
    if cuda_device is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(cuda_device)
    return env


def gpu_worker_specs(cfg: Config, cuda_count: int) -> list[tuple[str, int | None]]:
    """(name, CUDA device or None) of the embedded cluster's GPU workers: one per device.

    Raises:
        PlacementError: `cluster.num_gpus` above the machine's CUDA devices, or a placement the devices cannot hold
        (checked here so that no worker starts for a run that cannot be placed).
    """
    n, _ = num_devices(cfg, cuda_count)
    check_placement(cfg, cuda_count)  # also: cluster.num_gpus above the machine's CUDA devices
    return [(f"gpu-{i}", i if cuda_count else None) for i in range(n)]


def security(cfg: Config):
    """`cluster.security` -> a `distributed.Security`, or None when it sets nothing up (plain tcp://).

    An existing cluster (`cluster.address`): the CA and the client's cert/key. The embedded cluster:
    `Security.temporary()` (one in-memory self-signed certificate for every role; needs `cryptography`) or the
    CA with the client's, scheduler's and workers' certs/keys. `require_encryption` is true whenever TLS is set up
    (distributed then refuses plain connections). The values were checked by `SecurityConfig.check`.

    Raises:
        ConfigError: `cluster.security.temporary` without the `cryptography` package.
    """
    sec = cfg.cluster.security
    if not sec.enabled():
        return None
    from distributed import Security
    if sec.temporary:
        try:
            return Security.temporary()
        except ImportError:
            raise ConfigError("cluster.security.temporary", True, "needs the `cryptography` package (pip install "
                                                                  "cryptography), or give certificate files") from None
    roles = ("tls_ca_file", "tls_client_cert", "tls_client_key")
    if not cfg.cluster.address:
        roles += ("tls_scheduler_cert", "tls_scheduler_key", "tls_worker_cert", "tls_worker_key")
    files = {f: os.path.expanduser(getattr(sec, f)) for f in roles if getattr(sec, f)}
    return Security(require_encryption=True, **files)


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
    every one speaks tls://."""
    from distributed import Nanny, Scheduler
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
    workers = {}
    for i in range(c.num_env_workers):
        workers[f"env-{i}"] = {"cls": Nanny, "options": {**common, "name": f"env-{i}", "resources": {"CPU": 1},
                                                         "env": _worker_env(None, cfg.env.simulator)}}
    for name, device in gpus:
        workers[name] = {"cls": Nanny, "options": {
            **common, "name": name, "resources": {"GPU": 1},
            "env": {**_worker_env(device, "none"), "OMP_NUM_THREADS": str(actor_threads),
                    "OMP_WAIT_POLICY": "PASSIVE"}}}
    scheduler = {"cls": Scheduler, "options": {"host": c.host, "dashboard_address": c.dashboard_address, **proto}}
    return scheduler, workers


def start_cluster(cfg: Config) -> ClusterHandle:
    """Start the embedded local cluster or connect to `cluster.address`.

    Raises:
        ConnectionError (remote scheduler unreachable, with the address and the fix).
        PlacementError (a ConfigError) before any worker starts: more GPUs asked for than the machine or the
        config provides (`gpu_worker_specs`).
    """
    from distributed import Client
    c = cfg.cluster
    for name in ("distributed", "distributed.nanny", "distributed.scheduler", "distributed.worker",
                 "distributed.core", "distributed.http.proxy"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from pipelines.worker_preload import route_reported_failures
    route_reported_failures()  # the embedded scheduler (and an in-process worker) log into this console
    sec = security(cfg)
    if c.address:
        client = connect(c.address, c.connect_timeout_s, sec)
        resident.install(client)  # worker-resident objects live in a worker plugin (tasks.resident)
        return ClusterHandle(client, None, client.dashboard_link)
    gpus = gpu_worker_specs(cfg, _cuda_device_count())
    from distributed import SpecCluster
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
    resident.install(client)  # worker-resident objects live in a worker plugin (tasks.resident)
    return ClusterHandle(client, cluster, client.dashboard_link)


DASK_WORKER_TTL_S = 300.0  # distributed's default `distributed.scheduler.worker-ttl` (5 minutes)
TTL_MARGIN_S = 60.0  # the watch's own report comes this long before the scheduler would drop a silent worker


def scheduler_config(cfg: Config) -> dict:
    """The dask config the embedded scheduler is created under (`start_cluster`):

    * `distributed.scheduler.http.routes`: `scheduler_http_routes()` (a serialisable `/json/identity.json`);
    * `distributed.scheduler.worker-ttl`: max(distributed's 300 s, `runner.stall_timeout_s` + 60 s). The scheduler
      removes a worker it has not heard from for worker-ttl, and the run then counts it "lost (left the cluster or
      restarted)"; a worker that is only slow (a starved event loop on an oversubscribed machine) must not be
      dropped before the watch (pipelines.runner.recovery) says it was "not heard from" in its own line naming
      runner.stall_timeout_s, so the scheduler's bound follows the watch's.
    """
    ttl = max(DASK_WORKER_TTL_S, float(cfg.runner.stall_timeout_s) + TTL_MARGIN_S)
    return {"distributed.scheduler.http.routes": scheduler_http_routes(),
            "distributed.scheduler.worker-ttl": f"{ttl:g}s"}


def scheduler_http_routes() -> list[str]:
    """distributed's `distributed.scheduler.http.routes` with its JSON routes replaced by `pipelines.dashboard_json`
    (the embedded scheduler's `/json/identity.json` answered 500 with a traceback in the driver's console)."""
    import dask

    from pipelines import dashboard_json
    return [dashboard_json.__name__ if m == dashboard_json.REPLACES else m
            for m in dask.config.get("distributed.scheduler.http.routes")]


def cluster_info(client) -> dict:
    """The scheduler's identity with EVERY worker (`{"address", "workers": {address: info}, ...}`, as
    `Client.scheduler_info(n_workers=-1)` documents it), asked of the scheduler now; a dict is returned as it is
    (tests and the placement checks take one).

    Not `Client.scheduler_info()`: it refreshes a cache that the client's own periodic update (every
    `distributed.client.scheduler-info-interval`, 2 s) overwrites with an answer listing NO worker, and returns the
    cache after the refresh; on a loaded machine the update often lands in between (measured at load 15: 2 of 460
    answers missed live workers, the direct query 0 of 415), so the watch saw every placed worker "lost (left the
    cluster or restarted)" at once, and its second look 2 s later, in step with that period, agreed."""
    if isinstance(client, dict):
        return client
    from distributed import Client
    if not isinstance(client, Client):  # a stand-in (tests) answers scheduler_info itself
        return client.scheduler_info(n_workers=-1)
    return dict(client.sync(client.scheduler.identity, n_workers=-1))


def wait_for_workers(client, n: int, timeout: float) -> int:
    """Wait up to `timeout` s for `n` workers registered with the scheduler, in any state; returns how many there
    are. (Not `Client.wait_for_workers`: it counts running workers only, so a worker paused for memory makes it wait
    out its timeout and raise.)"""
    import time
    deadline = time.monotonic() + timeout
    while True:
        have = len(cluster_info(client)["workers"])
        if have >= n or time.monotonic() > deadline:
            return have
        time.sleep(0.5)


def connect(address: str, timeout_s: float, sec=None):
    """A Client for an existing scheduler, or ConnectionError (one line, with the fix) within `timeout_s`.
    `sec`: a distributed.Security for a tls:// scheduler (`security(cfg)`), else None.

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



# ----- placement on live workers -----

def _natural(name) -> list:
    """Sort key: gpu-2 before gpu-10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(name))]


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def _env_devices(env_w: list[str], gpu_w: list[str]) -> dict[str, int]:
    """env worker -> the device it serves: round-robin over the GPU workers on its host (all devices when its
    host has none, as on a one-host cluster where every worker is 127.0.0.1)."""
    by_host: dict[str, list[int]] = {}
    for d, g in enumerate(gpu_w):
        by_host.setdefault(_host(g), []).append(d)
    seen: Counter = Counter()
    out = {}
    for w in env_w:
        h = _host(w) if _host(w) in by_host else None
        devs = by_host[h] if h is not None else list(range(len(gpu_w)))
        out[w] = devs[seen[h] % len(devs)]
        seen[h] += 1
    return out


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
    by_name = sorted(workers.items(), key=lambda kv: (_natural(kv[1].get("name", kv[0])), kv[0]))
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


# ----- worker health (pipelines.recovery's watch) -----

def _health_on_scheduler(addrs: list[str], dask_scheduler=None) -> dict:
    """Runs on the scheduler: see `worker_health`."""
    from distributed.metrics import time as now
    t = now()
    out = {}
    for a in addrs:
        ws = dask_scheduler.workers.get(a)
        if ws is None:
            continue
        out[a] = {"name": str(ws.name), "status": ws.status.name, "memory": int(ws.memory.process),
                  "memory_limit": ws.memory_limit or None, "silent_s": float(t - ws.last_seen),
                  "executing": {str(ts.key): float(d) for ts, d in ws.executing.items()},
                  "processing": len(ws.processing)}
    return out


def worker_health(client, addrs: list[str]) -> dict[str, dict]:
    """The scheduler's view of the workers at `addrs` (absent ones are left out), in one query.

    Returns: address -> {"name", "status" ("running" | "paused" | ...), "memory" (process bytes, int),
    "memory_limit" (bytes or None), "silent_s" (seconds since the worker's last heartbeat), "executing"
    ({key: seconds it has been executing}), "processing" (tasks assigned to it)}.
    """
    return client.run_on_scheduler(_health_on_scheduler, list(addrs))


def _pause_fraction(dask_worker):
    """Runs on a worker: its memory pause fraction (False: never pauses)."""
    return dask_worker.memory_manager.memory_pause_fraction


def pause_fraction(client, addr: str, timeout: float = 10.0):
    """The memory pause fraction of the worker at `addr` (a paused worker still answers), or None if it does
    not answer within `timeout` seconds."""
    import threading
    box: dict = {}

    def ask():
        try:
            box["out"] = client.run(_pause_fraction, workers=[addr], on_error="return")[addr]
        except Exception:  # noqa: BLE001 - unknown
            pass

    t = threading.Thread(target=ask, daemon=True, name="dagrl-pause-fraction")
    t.start()
    t.join(timeout)
    out = box.get("out")
    return out if isinstance(out, (int, float)) else None
