"""The Kubernetes resources `cluster.kind=kubernetes` creates (pipelines/clusters/kubernetes.py), as plain data: one
`DaskCluster` of the Dask operator (kubernetes.dask.org/v1: the scheduler, its Service and the env workers as the
cluster's default worker group) and one `DaskWorkerGroup` `<name>-gpu` (the GPU workers), both derived from the
config and the placement, built without importing dask-kubernetes (`pipelines.validate` prints them on a machine
without it) and without contacting any cluster.

What dagrl's placement needs of the workers (pipelines/clusters/placement.py), and how the resources give it:
  env workers   `dask worker --resources CPU=1`, one per pod (the default worker group, `replicas` env workers);
  GPU workers   one Dask worker per GPU with `--resources GPU=1`: a pod with `cluster.gpus_per_worker` = g GPUs
                (`<gpu_resource>: g` in its limits) runs `dask cuda worker` (dask-cuda: one worker process per
                visible GPU, each named `<pod name>-i` when g > 1), so the GPU workers are pods x g = the placement's
                devices; `cluster.gpu_worker_command=dask` runs `dask worker` (one worker a pod: g <= 1, g = 0 a
                logical GPU worker on a CPU node).
Every worker is named `$(DASK_WORKER_NAME)` (the operator sets it per pod; device i = the i-th GPU worker by name),
has `cluster.threads_per_worker` threads and `cluster.memory_limit` as its Dask memory limit (as on the embedded
cluster; each pod's memory limit holds its workers': the kind's checks),
mounts `cluster.runs_volume_claim` at `cluster.runs_mount_path` (checkpoints come from the actor's worker,
trajectories from the env workers' writes under run_root) and preloads `pipelines.worker_preload`.
The scheduler's container and Service follow dask-kubernetes' `make_scheduler_spec` (ports 8786 tcp-comm and 8787
http-dashboard, `/health` probes); it runs under the worker-ttl and dashboard routes of dagrl's embedded scheduler
(`pipelines.clusters.handle.scheduler_config`).
"""
from __future__ import annotations

import math
import re

from tasks.config import Config

API_VERSION = "kubernetes.dask.org/v1"
SCHEDULER_PORT, DASHBOARD_PORT, WORKER_DASHBOARD_PORT = 8786, 8787, 8788
GPU_GROUP = "gpu"  # the DaskWorkerGroup `<name>-gpu`; the env workers are the DaskCluster's `<name>-default`
OPERATOR_ENV = ("DASK_WORKER_NAME", "DASK_SCHEDULER_ADDRESS")  # set in every worker pod by the operator

# Kubernetes quantities (k8s.io/apimachinery resource.Quantity): a number with a binary (Ki..Ei), decimal (n..E)
# suffix or an exponent
_QUANTITY = re.compile(r"([+]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
_FACTOR = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60, "n": 1e-9,
           "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def parse_quantity(text: str) -> float | None:
    """A Kubernetes quantity ("500m" CPU = 0.5 cores, "4Gi" = 4 * 2^30 bytes, "1e3") -> its value in base units
    (cores, bytes), None when `text` is not one (e.g. "4GiB", "4 Gi", "-1")."""
    m = _QUANTITY.fullmatch(str(text).strip())
    if m is None:
        return None
    number, suffix = float(m.group(1)), m.group(2) or ""
    if suffix[:1] in ("e", "E") and suffix not in _FACTOR:
        return number * 10.0 ** int(suffix[1:])
    return number * _FACTOR[suffix]


def group_counts(cfg: Config, n: int) -> dict[str, int]:
    """The workers the resources hold for `n` GPU devices (the placement's: `kubernetes.devices`):

    env_workers: `cluster.env_pods`, null: one per device (each device then served by one env worker, as
                 `placement._env_devices` pairs them);
    gpu_pods:    n / g pods of g = `cluster.gpus_per_worker` GPUs (n pods of a logical GPU worker when g = 0);
    workers_per_gpu_pod: the Dask workers of one GPU pod (g with `dask cuda worker`, else 1);
    gpu_workers: the Dask workers with resource GPU=1 (= n).
    Assumes the kind's checks passed (n a multiple of g)."""
    c = cfg.cluster
    g = c.gpus_per_worker
    per_pod = g if g >= 1 and c.gpu_worker_command == "cuda" else 1
    pods = n // per_pod
    env = c.env_pods if c.env_pods is not None else n
    return {"env_workers": env, "gpu_pods": pods, "workers_per_gpu_pod": per_pod, "gpu_workers": pods * per_pod}


def _resources(cpu: str, memory: str, cpu_limit: str | None, memory_limit: str | None,
               extra_limits: dict[str, str] | None = None) -> dict:
    """A container's `resources`: requests cpu/memory; limits memory (the request when not given), cpu only when
    given (a CPU limit throttles; none by default), and `extra_limits` (the GPUs: an extended resource is given
    as a limit, its request defaults to it). Every value a string (the CRD's schema: quantities as strings)."""
    limits = {"memory": str(memory_limit or memory)}
    if cpu_limit:
        limits["cpu"] = str(cpu_limit)
    limits.update(extra_limits or {})
    return {"requests": {"cpu": str(cpu), "memory": str(memory)}, "limits": limits}


def _env(pairs: dict[str, str], pod_env: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": str(v)} for k, v in {**pairs, **pod_env}.items()]


def _volumes(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(volumes of the pod, volumeMounts of its container): the run directory's claim."""
    c = cfg.cluster
    if not c.runs_volume_claim:
        return [], []
    return ([{"name": "runs", "persistentVolumeClaim": {"claimName": c.runs_volume_claim}}],
            [{"name": "runs", "mountPath": c.runs_mount_path}])


def _worker(cfg: Config, command: list[str], resource: str, replicas: int, env: dict[str, str], resources: dict,
            node_selector: dict[str, str] | None = None) -> dict:
    """A worker group's `worker` (the CRD's `replicas` + pod `spec`), args as dask-kubernetes' make_worker_spec
    gives them (name from $(DASK_WORKER_NAME), the dashboard on 8788) plus dagrl's threads, resource and preload."""
    c = cfg.cluster
    volumes, mounts = _volumes(cfg)
    args = [*command, "--name", "$(DASK_WORKER_NAME)", "--nthreads", str(c.threads_per_worker), "--memory-limit",
            str(c.memory_limit), "--resources", f"{resource}=1", "--dashboard", "--dashboard-address",
            str(WORKER_DASHBOARD_PORT), "--preload", "pipelines.worker_preload"]
    container = {"name": "worker", "image": c.image, "imagePullPolicy": c.image_pull_policy, "args": args,
                 "env": _env(env, dict(c.pod_env)), "resources": resources,
                 "ports": [{"name": "http-dashboard", "containerPort": WORKER_DASHBOARD_PORT, "protocol": "TCP"}]}
    if mounts:
        container["volumeMounts"] = mounts
    spec: dict = {"containers": [container]}
    if volumes:
        spec["volumes"] = volumes
    if node_selector:
        spec["nodeSelector"] = {str(k): str(v) for k, v in node_selector.items()}
    return {"replicas": replicas, "spec": spec}


def _scheduler(cfg: Config) -> dict:
    """The DaskCluster's `scheduler`: container (dask-kubernetes' make_scheduler_spec's ports and probes; `dask
    scheduler` under the embedded scheduler's worker-ttl and dashboard routes) and Service."""
    from pipelines.clusters.handle import scheduler_config
    c = cfg.cluster
    conf = scheduler_config(cfg)
    env = {"DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": conf["distributed.scheduler.worker-ttl"],
           "DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES": repr(list(conf["distributed.scheduler.http.routes"]))}
    probe = {"httpGet": {"port": "http-dashboard", "path": "/health"}}
    container = {
        "name": "scheduler", "image": c.image, "imagePullPolicy": c.image_pull_policy,
        "args": ["dask", "scheduler", "--host", "0.0.0.0", "--port", str(SCHEDULER_PORT), "--dashboard-address",
                 f":{DASHBOARD_PORT}"],
        "env": _env(env, dict(c.pod_env)),
        "resources": _resources(c.scheduler_cpu, c.scheduler_memory, None, None),
        "ports": [{"name": "tcp-comm", "containerPort": SCHEDULER_PORT, "protocol": "TCP"},
                  {"name": "http-dashboard", "containerPort": DASHBOARD_PORT, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 0, "periodSeconds": 1, "timeoutSeconds": 300},
        "livenessProbe": {**probe, "initialDelaySeconds": 15, "periodSeconds": 20},
    }
    service = {"type": c.service_type,
               "selector": {"dask.org/cluster-name": c.name, "dask.org/component": "scheduler"},
               "ports": [{"name": "tcp-comm", "protocol": "TCP", "port": SCHEDULER_PORT, "targetPort": "tcp-comm"},
                         {"name": "http-dashboard", "protocol": "TCP", "port": DASHBOARD_PORT,
                          "targetPort": "http-dashboard"}]}
    return {"spec": {"containers": [container]}, "service": service}


def _metadata(cfg: Config, name: str, labels: bool = True) -> dict:
    """metadata: the name, the namespace when configured, and (the DaskCluster's) a part-of label. The
    DaskWorkerGroup's carries none: KubeCluster.add_worker_group creates it with its name and namespace only."""
    meta: dict = {"name": name}
    if cfg.cluster.namespace:
        meta["namespace"] = cfg.cluster.namespace
    if labels:
        meta["labels"] = {"app.kubernetes.io/part-of": "dagrl"}
    return meta


def cluster_resources(cfg: Config, n: int) -> list[dict]:
    """[DaskCluster, DaskWorkerGroup] for `n` GPU devices (the module docstring; `group_counts` for the numbers).

    The env workers (default group): `--resources CPU=1`, OMP/MKL threads 1 (a shard is one simulator). The GPU
    workers: `--resources GPU=1`, `<cluster.gpu_resource>: gpus_per_worker` in the pod's limits (none for a
    logical GPU worker), OMP_NUM_THREADS = the pod's CPU request / its Dask workers (at least 1) with
    OMP_WAIT_POLICY=PASSIVE (as the embedded cluster's actor worker: pipelines/clusters/local.py).
    Pure: builds dicts, contacts nothing."""
    c = cfg.cluster
    counts = group_counts(cfg, n)
    g = c.gpus_per_worker
    env_worker = _worker(cfg, ["dask", "worker"], "CPU", counts["env_workers"],
                         {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                         _resources(c.env_worker_cpu, c.env_worker_memory, c.env_worker_cpu_limit,
                                    c.env_worker_memory_limit))
    threads = max(1, math.floor((parse_quantity(c.gpu_worker_cpu) or 1) / counts["workers_per_gpu_pod"]))
    command = ["dask", "cuda", "worker"] if c.gpu_worker_command == "cuda" else ["dask", "worker"]
    gpu_worker = _worker(cfg, command, "GPU", counts["gpu_pods"],
                         {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE", "PYTHONWARNINGS": "ignore"},
                         _resources(c.gpu_worker_cpu, c.gpu_worker_memory, c.gpu_worker_cpu_limit,
                                    c.gpu_worker_memory_limit, {c.gpu_resource: str(g)} if g else None),
                         dict(c.gpu_node_selector))
    cluster = {"apiVersion": API_VERSION, "kind": "DaskCluster", "metadata": _metadata(cfg, c.name),
               "spec": {"idleTimeout": 0, "worker": env_worker, "scheduler": _scheduler(cfg)}}
    group = {"apiVersion": API_VERSION, "kind": "DaskWorkerGroup",
             "metadata": _metadata(cfg, f"{c.name}-{GPU_GROUP}", labels=False),
             "spec": {"cluster": c.name, "worker": gpu_worker}}
    return [cluster, group]


def to_yaml(resources: list[dict]) -> str:
    """The resources as one YAML stream (`kubectl apply -f -` reads it), keys in the order built."""
    import yaml

    class Dumper(yaml.SafeDumper):  # a dict used twice (the probes' httpGet) is written out twice, not as an alias
        def ignore_aliases(self, data) -> bool:
            return True
    return "".join("---\n" + yaml.dump(r, Dumper=Dumper, sort_keys=False, default_flow_style=False)
                   for r in resources)
