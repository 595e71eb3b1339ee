"""`cluster.kind=kubernetes`: a Dask cluster on Kubernetes through the Dask operator (dask-kubernetes: the
`DaskCluster` / `DaskWorkerGroup` resources), created when the run starts and deleted when it ends.

The resources (pipelines/clusters/kubernetes_spec.py): the scheduler with its Service (`cluster.service_type`),
the env workers (`dask worker --resources CPU=1`, the DaskCluster's default group) and the GPU workers (the
DaskWorkerGroup `<name>-gpu`: pods with `cluster.gpus_per_worker` GPUs each running `dask cuda worker --resources
GPU=1`, one Dask worker per GPU), sized from the placement: the GPU workers are the devices
`cluster.component_placement` uses (`cluster.num_gpus` when set), the env workers one per device unless
`cluster.env_pods`. Every pod runs `cluster.image` (the Dockerfile's image, pushed where the cluster pulls
from) and mounts `cluster.runs_volume_claim` (a ReadWriteMany PersistentVolumeClaim) at `cluster.runs_mount_path`,
where the driver's `run_root` must be too: run the driver in a pod mounting the same claim (deploy/driver.yaml).

`python -m pipelines.validate cluster=kubernetes ...` prints the resources as YAML without contacting a cluster
(`describe`); deploy/ holds the same resources for users who apply them themselves (then `cluster=address`).
Starting needs the `kubernetes` extra (`pip install -e '.[kubernetes]'`: dask-kubernetes), a reachable API (the
kubeconfig, or the pod's service account) and the operator installed (deploy/README.md).

The kind's interface (`pipelines.clusters.ClusterKind`): `start`, `check_machine`, `devices`, `env_served`,
`rejoin`, `describe`, `attach`, `TLS_ROLES`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from pipelines.bounded import bounded
from pipelines.clusters import kubernetes_spec as spec
from pipelines.clusters.checks import check_cluster
from pipelines.clusters.handle import ClusterHandle
from tasks.config import Config, ConfigError, register_family
from tasks.config.schema import ClusterConfig

KIND = "cluster.kind=kubernetes"
DEPLOY = "deploy/README.md"


TLS_ROLES: tuple[str, ...] = ()  # TLS is refused for this kind (check_kubernetes)

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# dask-kubernetes' VALID_CLUSTER_NAME: an RFC 1123 label short enough for "<name>-scheduler" (63 characters)
MAX_NAME = 63 - len("-scheduler")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_EXTENDED = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
CHOICES = {"service_type": ("ClusterIP", "NodePort", "LoadBalancer"),
           "image_pull_policy": ("IfNotPresent", "Always", "Never"), "gpu_worker_command": ("cuda", "dask")}
QUANTITY_FIX = "a Kubernetes quantity: CPU as 1, 2 or 500m; memory as 4Gi, 4096Mi or 4G (no 'B')"


def _quantities(c) -> None:
    """Every CPU and memory key a quantity; memory at least 64Mi; each limit at least its request."""
    for group in ("scheduler", "env_worker", "gpu_worker"):
        for what in ("cpu", "memory"):
            key = f"{group}_{what}"
            request = spec.parse_quantity(getattr(c, key))
            if request is None or request <= 0:
                raise ConfigError(f"cluster.{key}", getattr(c, key), f"must be {QUANTITY_FIX}")
            if what == "memory" and request < 64 * 2 ** 20:
                raise ConfigError(f"cluster.{key}", getattr(c, key), "is below 64Mi: a Dask process needs more; "
                                                                     "give e.g. 4Gi ('m' is milli-bytes)")
            if group == "scheduler":
                continue
            lkey = f"{key}_limit"
            limit_text = getattr(c, lkey)
            if limit_text is None:
                continue
            limit = spec.parse_quantity(limit_text)
            if limit is None:
                raise ConfigError(f"cluster.{lkey}", limit_text, f"must be {QUANTITY_FIX}, or null")
            if limit < request:
                raise ConfigError(f"cluster.{lkey}", limit_text, f"is below its request cluster.{key}="
                                                                 f"{getattr(c, key)}: raise it or lower the request")


def _dask_memory(cfg: Config) -> None:
    """Each worker pod's memory limit holds its Dask workers' `cluster.memory_limit` (every worker's, as on the
    embedded cluster: the env memory estimates count on it): a GPU pod under `dask cuda worker` runs one worker
    per GPU."""
    from dask.utils import parse_bytes
    c = cfg.cluster
    try:
        per_worker = parse_bytes(c.memory_limit)
    except (ValueError, TypeError):
        raise ConfigError("cluster.memory_limit", c.memory_limit, "a Dask memory size per worker, e.g. 3GiB, "
                                                                  "16GiB") from None
    per_pod = {"env_worker": 1, "gpu_worker": spec.group_counts(cfg, 1)["workers_per_gpu_pod"]}
    for group, workers in per_pod.items():
        key = f"{group}_memory_limit" if getattr(c, f"{group}_memory_limit") else f"{group}_memory"
        have = spec.parse_quantity(getattr(c, key))
        if have < per_worker * workers:
            need = f"{per_worker * workers / 2 ** 30:g}Gi"
            raise ConfigError(f"cluster.{key}", getattr(c, key),
                              f"holds less than its {workers} Dask worker{'s' if workers != 1 else ''} of "
                              f"cluster.memory_limit={c.memory_limit}: give at least {need}, or lower "
                              f"cluster.memory_limit")


def _names(c) -> None:
    if len(c.name) > MAX_NAME or not _DNS_LABEL.fullmatch(c.name):
        raise ConfigError("cluster.name", c.name, f"the DaskCluster's name: lowercase letters, digits and '-', "
                                                  f"starting and ending with a letter or digit, at most {MAX_NAME} "
                                                  f"characters (e.g. dagrl-pushcube)")
    if c.namespace is not None and (len(c.namespace) > 63 or not _DNS_LABEL.fullmatch(c.namespace)):
        raise ConfigError("cluster.namespace", c.namespace, "a Kubernetes namespace: lowercase letters, digits "
                                                            "and '-', at most 63 characters; or null for the "
                                                            "kubeconfig's")
    for key, choices in CHOICES.items():
        if getattr(c, key) not in choices:
            raise ConfigError(f"cluster.{key}", getattr(c, key), f"use one of {list(choices)}")
    if not _EXTENDED.fullmatch(c.gpu_resource):
        raise ConfigError("cluster.gpu_resource", c.gpu_resource, "an extended resource DOMAIN/NAME as the "
                                                                  "device plugin names it (nvidia.com/gpu, "
                                                                  "amd.com/gpu)")
    for k in c.pod_env:
        if not _ENV_NAME.fullmatch(str(k)) or k in spec.OPERATOR_ENV:
            raise ConfigError(f"cluster.pod_env.{k}", c.pod_env[k],
                              f"{'the operator sets it in every pod' if k in spec.OPERATOR_ENV else 'not a name'}"
                              f": use a variable name of letters, digits, '_', '-', '.' other than "
                              f"{' and '.join(spec.OPERATOR_ENV)}")


def _gpus(cfg: Config) -> None:
    """The GPU pods against the command, the devices and policy.device."""
    c = cfg.cluster
    g = c.gpus_per_worker
    if g < 0:
        raise ConfigError("cluster.gpus_per_worker", g, "must be >= 0 (0: a logical GPU worker on a CPU node)")
    if c.gpu_worker_command == "cuda" and g == 0:
        raise ConfigError("cluster.gpus_per_worker", 0, "`dask cuda worker` (cluster.gpu_worker_command=cuda) "
                                                        "needs GPUs: give the GPUs per pod (>= 1), or "
                                                        "cluster.gpu_worker_command=dask for logical GPU workers "
                                                        "on CPU nodes")
    if c.gpu_worker_command == "dask" and g > 1:
        raise ConfigError("cluster.gpus_per_worker", g, f"with cluster.gpu_worker_command=dask a pod runs one Dask "
                                                        f"worker, which would hold all {g} GPUs while dagrl places "
                                                        f"one actor rank or inference group per GPU worker (device i "
                                                        f"= the i-th GPU worker): use cluster.gpu_worker_command=cuda "
                                                        f"(one worker per GPU) or cluster.gpus_per_worker=1")
    if g == 0 and cfg.policy.device == "cuda":
        raise ConfigError("cluster.gpus_per_worker", 0, "logical GPU workers have no GPU and policy.device=cuda "
                                                        "needs one: give the GPUs per pod (>= 1), or set "
                                                        "policy.device=cpu")
    n, source = devices(cfg, 0)
    if g >= 1 and n % g:
        key = "cluster.num_gpus" if c.num_gpus is not None else "cluster.gpus_per_worker"
        raise ConfigError(key, getattr(c, key.split(".")[1]),
                          f"{n} GPU devices ({source}) do not fill pods of {g} GPUs (cluster.gpus_per_worker): "
                          f"use a multiple of {g} devices (cluster.num_gpus) or gpus_per_worker dividing {n}")


def check_run_root(cfg: Config, resolved: bool = False) -> None:
    """`run_root` on the runs volume: the workers write checkpoints and trajectories under it, so it must be under
    `cluster.runs_mount_path` as the driver sees it. An absolute `run_root` is checked offline; a relative one
    (`resolved`=True: at start) against the driver's working directory (deploy/driver.yaml's pod: /dagrl)."""
    c = cfg.cluster
    root = str(cfg.run_root)
    if not (resolved or os.path.isabs(root)):
        return
    path, mount = os.path.abspath(os.path.expanduser(root)), os.path.normpath(c.runs_mount_path)
    if path != mount and not path.startswith(mount.rstrip("/") + "/"):
        raise ConfigError("run_root", root, f"is {path} here, outside cluster.runs_mount_path={mount} where the "
                                            f"workers write checkpoints and trajectories: run the driver in a pod "
                                            f"mounting cluster.runs_volume_claim there with run_root={mount} "
                                            f"(deploy/driver.yaml), or set cluster.runs_mount_path")


def check_kubernetes(cfg: Config) -> None:
    """`cluster.kind=kubernetes`: an image; names Kubernetes accepts; quantities (limits >= requests); the GPU
    pods against the command, the devices and policy.device; env pods >= 1; each pod's memory for its Dask
    workers' `cluster.memory_limit`; the runs volume and run_root on it; a positive start timeout; no TLS (the
    operator's pods get no certificates from dagrl). Each raises ConfigError naming the key and the fix."""
    from pipelines.clusters.tls import tls_enabled
    c = cfg.cluster
    if not c.image:
        raise ConfigError("cluster.image", c.image, "every pod (scheduler, env and GPU workers) runs this image: "
                                                    "build the Dockerfile with the cuda and kubernetes extras "
                                                    "(docker build --build-arg EXTRAS=server,cuda,kubernetes -t "
                                                    "REGISTRY/dagrl:TAG .), push it where the nodes pull from and "
                                                    "give cluster.image=REGISTRY/dagrl:TAG")
    _names(c)
    _quantities(c)
    if c.env_pods is not None and c.env_pods < 1:
        raise ConfigError("cluster.env_pods", c.env_pods, "need at least 1, or null for one per GPU")
    _gpus(cfg)
    _dask_memory(cfg)
    if not c.runs_volume_claim:
        raise ConfigError("cluster.runs_volume_claim", c.runs_volume_claim,
                          "the workers write checkpoints and trajectories under run_root: give a ReadWriteMany "
                          f"PersistentVolumeClaim in the cluster's namespace (deploy/runs-pvc.yaml; {DEPLOY})")
    if not _DNS_LABEL.fullmatch(c.runs_volume_claim) or len(c.runs_volume_claim) > 253:
        raise ConfigError("cluster.runs_volume_claim", c.runs_volume_claim, "a PersistentVolumeClaim's name: "
                                                                            "lowercase letters, digits and '-'")
    if not os.path.isabs(c.runs_mount_path):
        raise ConfigError("cluster.runs_mount_path", c.runs_mount_path, "an absolute path in the pods, e.g. "
                                                                        "/dagrl/runs")
    check_run_root(cfg)
    if not c.start_timeout_s > 0:
        raise ConfigError("cluster.start_timeout_s", c.start_timeout_s, "must be > 0 (seconds for every worker "
                                                                        "to join)")
    if tls_enabled(c.security):
        raise ConfigError("cluster.security", "TLS", "the operator's pods get no certificates from dagrl: drop "
                                                     "cluster.security, or apply deploy/ with your certificates "
                                                     "mounted and connect with cluster=address and "
                                                     "cluster.security")


@register_family("cluster", "kubernetes", checks=(check_cluster, check_kubernetes))
@dataclass(frozen=True)
class KubernetesClusterConfig(ClusterConfig):
    """`cluster` with `kind: kubernetes` (conf/cluster/kubernetes.yaml): the DaskCluster to create. Quantities
    are Kubernetes' ("500m" CPU, "4Gi" memory); a memory limit left null equals its request, a CPU limit left
    null is none (no throttling)."""

    kind: str = "kubernetes"
    name: str = "dagrl"  # the DaskCluster (pods <name>-scheduler, <name>-default-worker-*, <name>-gpu-worker-*)
    namespace: Optional[str] = None  # null: the kubeconfig context's namespace (in a pod: its own)
    image: Optional[str] = None  # required: the Dockerfile's image (EXTRAS=server,cuda,kubernetes) the nodes pull
    image_pull_policy: str = "IfNotPresent"  # the pods' imagePullPolicy: IfNotPresent | Always | Never
    service_type: str = "ClusterIP"  # the scheduler's Service: ClusterIP | NodePort | LoadBalancer
    env_pods: Optional[int] = None  # env (CPU=1) worker pods; null: one per GPU device
    gpus_per_worker: int = 1  # GPUs of one GPU pod (its gpu_resource limit); 0: a logical GPU worker on a CPU node
    gpu_worker_command: str = "cuda"  # cuda: `dask cuda worker` (a worker per GPU); dask: `dask worker` (one a pod)
    gpu_resource: str = "nvidia.com/gpu"  # the device plugin's extended resource
    scheduler_cpu: str = "1"  # the scheduler pod's CPU request
    scheduler_memory: str = "2Gi"  # the scheduler pod's memory request
    env_worker_cpu: str = "1"  # an env worker pod's CPU request
    env_worker_memory: str = "4Gi"  # an env worker pod's memory request
    env_worker_cpu_limit: Optional[str] = None  # its CPU limit; null: none
    env_worker_memory_limit: Optional[str] = None  # its memory limit; null: the request
    gpu_worker_cpu: str = "4"  # also the torch threads of its Dask workers (divided among them)
    gpu_worker_memory: str = "32Gi"  # a GPU worker pod's memory request
    gpu_worker_cpu_limit: Optional[str] = None  # its CPU limit; null: none
    gpu_worker_memory_limit: Optional[str] = None  # its memory limit; null: the request
    gpu_node_selector: dict[str, str] = field(default_factory=dict)  # e.g. {nvidia.com/gpu.product: NVIDIA-H100...}
    pod_env: dict[str, str] = field(default_factory=dict)  # environment variables of every pod
    runs_volume_claim: Optional[str] = None  # required: a ReadWriteMany PVC holding run_root (deploy/runs-pvc.yaml)
    runs_mount_path: str = "/dagrl/runs"  # where every pod mounts it (the image's WORKDIR is /dagrl: run_root=runs)
    start_timeout_s: float = 600.0  # every worker joined within this (pulling images, scheduling GPU pods)
    WORKERS_HERE: ClassVar[bool] = False  # the workers are pods (policy.device=cuda needs no CUDA here)

    @property
    def env_workers(self) -> Optional[int]:
        """The env workers when `env_pods` is given (else one per device, known with the placement)."""
        return self.env_pods

    @staticmethod
    def inert_keys(cfg: Config, command: str = "run", cuda_count: int = 0) -> list[tuple[str, str]]:
        """With `gpus_per_worker=0` (logical GPU workers): `gpu_resource` and `gpu_node_selector` (no GPU asked
        for)."""
        if cfg.cluster.gpus_per_worker != 0:
            return []
        why = "cluster.gpus_per_worker=0 starts logical GPU workers on CPU nodes (no GPU asked for): drop it"
        return [("cluster.gpu_resource", why), ("cluster.gpu_node_selector", why)]


# ----- the kind's interface -----

def devices(cfg: Config, cuda_count: int) -> tuple[int, str]:
    """(GPU devices, where the number comes from) with `cluster.num_gpus` null: what the placement uses, the
    highest device index `cluster.component_placement` names + 1 and at least `algorithm.num_actor_ranks` (one GPU
    worker per rank) and 1. `cuda_count` (this machine's) plays no part: the GPUs are the pods'."""
    from pipelines.clusters.placement import _entries, parse_devices
    c = cfg.cluster
    if c.num_gpus is not None:
        return c.num_gpus, f"cluster.num_gpus={c.num_gpus}"
    named = [d for k, v in _entries(c.component_placement).values() for d in (parse_devices(k, v, None) or ())]
    top, ranks = (max(named) + 1 if named else 0), cfg.algorithm.num_actor_ranks
    n = max(1, top, ranks)
    why = ("the highest device cluster.component_placement names" if n == top and top > 1 else
           f"algorithm.num_actor_ranks={ranks}" if n == ranks and ranks > 1 else "the default placement")
    return n, f"{why}; cluster.num_gpus sets it"


def check_machine(cfg: Config, cuda_count: int) -> None:
    """Nothing to check on this machine: the workers are pods."""


def env_served(cfg: Config, n: int) -> list[int]:
    """The device each env worker serves, known before start: every pod has its own address, so env worker j (by
    name) serves device j % n (`placement._env_devices` round-robins over every GPU worker of another host)."""
    return [j % n for j in range(spec.group_counts(cfg, n)["env_workers"])]


def _n(cfg: Config) -> int:
    return cfg.cluster.num_gpus if cfg.cluster.num_gpus is not None else devices(cfg, 0)[0]


def rejoin(cfg: Config) -> tuple[int, float]:
    """(workers the whole cluster has: env + GPU workers, seconds to wait for them after a restart)."""
    counts = spec.group_counts(cfg, _n(cfg))
    return counts["env_workers"] + counts["gpu_workers"], cfg.cluster.start_timeout_s


def describe(cfg: Config, num_devices: int | None) -> str:
    """For `pipelines.validate`: one line naming the DaskCluster and its worker groups, then the resources `start`
    would create, as YAML indented by 4 (`kubernetes_spec.cluster_resources`; nothing is contacted)."""
    c = cfg.cluster
    n = num_devices or _n(cfg)
    counts = spec.group_counts(cfg, n)
    g = c.gpus_per_worker
    def many(k: int, what: str) -> str:
        return f"{k} {what}{'s' if k != 1 else ''}"
    gpu = (f"{many(counts['gpu_pods'], 'GPU pod')} x {g} {c.gpu_resource} "
           f"({'dask cuda worker' if c.gpu_worker_command == 'cuda' else 'dask worker'}) = "
           f"{many(counts['gpu_workers'], 'GPU worker')}" if g else
           f"{many(counts['gpu_pods'], 'logical GPU worker')} (no GPU)")
    namespace = c.namespace or "(the kubeconfig context's)"
    head = (f"kubernetes, DaskCluster {c.name} in namespace {namespace}: "
            f"{many(counts['env_workers'], 'env worker')} (CPU) + {gpu}; image {c.image}; resources (pipelines.run "
            f"creates them through the Dask operator and deletes them when it ends):")
    body = spec.to_yaml(spec.cluster_resources(cfg, n))
    return "\n".join([head, *(f"    {line}" for line in body.rstrip().splitlines())])


def attach(cfg: Config):
    """The kind's cluster exists only while a run holds it: ConfigError naming cluster.kind, with the address of
    a cluster applied from deploy/ (`--connect` checks an existing scheduler)."""
    raise ConfigError("cluster.kind", "kubernetes", f"--connect checks an existing scheduler; this kind creates "
                                                    f"its cluster when the run starts. For the resources of deploy/ "
                                                    f"applied yourself: cluster=address cluster.address=tcp://"
                                                    f"{cfg.cluster.name}-scheduler:{spec.SCHEDULER_PORT}")


# ----- starting (needs the `kubernetes` extra and a reachable cluster) -----

API_FIX = ("point KUBECONFIG (or ~/.kube/config) at the cluster, or run the driver in a pod with deploy/driver.yaml's "
           "service account; or use cluster.kind=local (this machine) or cluster.kind=address (a running scheduler)")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def connect_api(cfg: Config, timeout_s: float = 30.0):
    """A kr8s Api of the cluster the kubeconfig (or the pod's service account) names, with the Dask operator's
    DaskCluster kind installed; nothing is created.

    Raises:
        ConnectionError, one line naming cluster.kind and the fix: dask-kubernetes not installed (the `kubernetes`
        extra), no Kubernetes API reachable within `timeout_s`, or the operator's CRDs missing.
    """
    try:
        import kr8s
        import dask_kubernetes.operator  # noqa: F401 - KubeCluster, below
    except ImportError:
        raise ConnectionError(f"{KIND} needs dask-kubernetes, not installed here: pip install -e '.[kubernetes]' "
                              f"(or use cluster.kind=local / cluster.kind=address)") from None
    try:
        api = bounded(lambda: kr8s.api(namespace=cfg.cluster.namespace), timeout=timeout_s, what="kubeconfig")
        bounded(api.version, timeout=timeout_s, what="the Kubernetes API server")
    except Exception as exc:  # noqa: BLE001 - kr8s raises many kinds; all mean "not reachable"
        raise ConnectionError(f"{KIND}: no Kubernetes API reachable ({_one_line(exc)}); {API_FIX}") from None
    try:
        bounded(lambda: api.lookup_kind(f"daskcluster.{spec.API_VERSION}"), timeout=timeout_s,
                what="the DaskCluster kind")
    except Exception as exc:  # noqa: BLE001
        raise ConnectionError(f"{KIND}: the Dask operator is not installed in the cluster ({_one_line(exc)}); "
                              f"install it: helm install --repo https://helm.dask.org --create-namespace -n "
                              f"dask-operator --generate-name dask-kubernetes-operator ({DEPLOY})") from None
    return api


def pod_reasons(pods: list[dict]) -> list[str]:
    """Why each of `pods` (Pod resources as dicts: metadata, status) is not running yet, one short entry each
    ("NAME: Unschedulable: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu", "NAME: ImagePullBackOff");
    running and ready pods are left out."""
    out = []
    for pod in pods:
        status, name = pod.get("status") or {}, (pod.get("metadata") or {}).get("name", "?")
        conditions = {c.get("type"): c for c in status.get("conditions") or []}
        if status.get("phase") == "Running" and (conditions.get("Ready") or {}).get("status") == "True":
            continue
        why = status.get("phase") or "Pending"
        sched = conditions.get("PodScheduled") or {}
        if sched.get("status") == "False":
            why = f"{sched.get('reason', 'Unschedulable')}: {sched.get('message', '')}".rstrip(": ")
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting")
            if waiting:
                why = f"{waiting.get('reason', 'Waiting')}" + (f": {waiting['message']}" if waiting.get("message")
                                                               else "")
        out.append(f"{name}: {why}")
    return out


def _not_joined(cfg: Config, have: int, want: int, namespace: str) -> str:
    """The one line of a cluster whose workers did not all join: the pods still pending and why."""
    try:
        import kr8s
        pods = kr8s.get("pods", namespace=namespace, label_selector={"dask.org/cluster-name": cfg.cluster.name})
        reasons = pod_reasons([p.raw for p in pods])
    except Exception as exc:  # noqa: BLE001 - the line is still worth printing
        reasons = [f"(pods not listed: {_one_line(exc)})"]
    return (f"cluster.start_timeout_s={cfg.cluster.start_timeout_s:g}: {have} of {want} workers joined the "
            f"DaskCluster {cfg.cluster.name} in namespace {namespace}; not running: "
            f"{'; '.join(reasons) or 'none (workers starting)'}; fix what the pods say (image, GPU nodes, quota) or "
            f"raise cluster.start_timeout_s. The cluster is deleted")


def start(cfg: Config) -> ClusterHandle:
    """Create the DaskCluster (`kubernetes_spec.cluster_resources`: KubeCluster(custom_cluster_spec=...) and the GPU
    DaskWorkerGroup), connect, and wait for every worker within `cluster.start_timeout_s`; the handle's close
    deletes it (the operator removes its pods).

    Raises:
        ConfigError: the driver's run_root outside cluster.runs_mount_path (before anything is created).
        ConnectionError, one line with the fix: no dask-kubernetes, no API, no operator (`connect_api`); a
        DaskCluster of that name exists; the operator or the scheduler did not come up; workers missing after
        `cluster.start_timeout_s` (the pods not running and why). A cluster created here is deleted first.
    """
    from distributed import Client
    from dask_kubernetes.operator.kubecluster.kubecluster import CreateMode, KubeCluster

    from pipelines.clusters.info import wait_for_workers
    c = cfg.cluster
    check_run_root(cfg, resolved=True)
    api = connect_api(cfg)
    namespace = c.namespace or api.namespace
    n = _n(cfg)
    daskcluster, group = spec.cluster_resources(cfg, n)
    counts = spec.group_counts(cfg, n)
    want = counts["env_workers"] + counts["gpu_workers"]
    cluster = None
    try:
        try:
            cluster = KubeCluster(custom_cluster_spec=daskcluster, namespace=namespace, quiet=True,
                                  create_mode=CreateMode.CREATE_ONLY, shutdown_on_close=True,
                                  resource_timeout=int(c.start_timeout_s))
        except ValueError as exc:
            if "already exists" not in str(exc):
                raise
            raise ConnectionError(f"cluster.name={c.name!r}: a DaskCluster {c.name} exists in namespace {namespace} "
                                  f"(another run's, or left by a killed driver): kubectl delete daskcluster {c.name} "
                                  f"-n {namespace}, or choose another cluster.name") from None
        cluster.add_worker_group(spec.GPU_GROUP, custom_spec=group["spec"]["worker"])
        client = Client(cluster)
        have = wait_for_workers(client, want, c.start_timeout_s)
        if have < want:
            line = _not_joined(cfg, have, want, namespace)
            ClusterHandle(client, cluster, "").close()
            cluster = None
            raise ConnectionError(line)
        return ClusterHandle(client, cluster, cluster.dashboard_link)
    except ConnectionError:
        raise
    except BaseException as exc:  # an interrupt or a failure of the operator: no DaskCluster left behind
        if cluster is not None:
            try:
                cluster.close(timeout=60)
            except Exception:  # noqa: BLE001 - the error below is the one to report
                pass
        if isinstance(exc, Exception):
            raise ConnectionError(f"{KIND}: the DaskCluster {c.name} did not start ({_one_line(exc)}); see "
                                  f"`kubectl describe daskcluster {c.name} -n {namespace}` and the operator's log "
                                  f"({DEPLOY})") from None
        raise
