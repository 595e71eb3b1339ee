"""`cluster.kind=kubernetes` (pipelines/clusters/kubernetes.py, kubernetes_spec.py) and deploy/, tested without a
Kubernetes cluster (none runs here):

* the resources it creates are checked against the Dask operator's own CRD schemas (the `DaskCluster` and
  `DaskWorkerGroup` CustomResourceDefinitions shipped in dask-kubernetes, made strict the way the API server's
  strict field validation is: an unknown field is an error) and against dask-kubernetes' `make_scheduler_spec`;
* the workers those resources would register (one per env pod; one per GPU of a GPU pod under `dask cuda worker`,
  named as dask-cuda names them) are planned by dagrl's placement (`plan_placement`) into the devices the offline
  check derives, for several placements;
* deploy/: the DaskCluster manifest equals what the kind generates for the overrides its header names and passes the
  CRDs; the driver Job, its RBAC and the volume claim pass the Kubernetes client's models (unknown fields, types,
  required fields), and the Job's command is a config that passes the checks;
* bad settings are refused with the key and the fix; `pipelines.validate` prints the resources with dask-kubernetes
  made unimportable (so nothing can contact a cluster); without a reachable API, starting fails in one line naming
  cluster.kind and the fix.
What is not tested here: creating the resources on a real cluster, the operator acting on them, pods scheduling on
GPU nodes, `dask cuda worker` on a GPU.
"""
from __future__ import annotations

import copy
import functools
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import pipelines.clusters as pc
from pipelines.clusters import kubernetes as k8s
from pipelines.clusters import kubernetes_spec as spec
from pipelines.clusters.placement import _env_devices, check_placement, natural_order, plan_placement
from pipelines.config import load_config
from tasks.config import ConfigError, family_class

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
BASE = ["cluster=kubernetes", "cluster.image=registry.example.com/dagrl:test", "cluster.runs_volume_claim=dagrl-runs"]


def _cfg(*overrides: str, components: bool = False):
    return load_config([*BASE, *overrides], components=components, notes=[])[0]


def test_the_kind_is_one_module_with_the_interface():
    """As every kind (tests/pipelines/test_clusters.py): the config class subclasses the shared base and selects
    itself; its module provides the ClusterKind interface; what it knows offline comes from the config."""
    import dataclasses

    from tasks.config.schema import ClusterConfig
    cls = family_class("cluster", "kubernetes")
    assert issubclass(cls, ClusterConfig) and cls().kind == "kubernetes" and not cls.WORKERS_HERE
    cfg = _cfg()
    module = pc.kind_of(cfg)
    assert module is k8s
    assert all(callable(getattr(module, name)) for name in ("start", "check_machine", "devices", "env_served",
                                                            "rejoin", "describe", "attach"))
    assert set(module.TLS_ROLES) <= {f.name for f in dataclasses.fields(cls().security)}
    with pytest.raises(ConfigError, match=r"cluster=address cluster\.address=tcp://dagrl-scheduler:8786"):
        pc.attach(cfg)
    # the devices: the placement's (highest device named + 1, at least the actor ranks), cluster.num_gpus when set
    assert k8s.devices(_cfg("cluster.component_placement.env=0-2"), 8)[0] == 3
    assert pc.num_devices(_cfg("cluster.num_gpus=4"), 0)[0] == 4


# ----- the operator's CRDs as JSON schemas -----

def _strict(schema: dict) -> dict:
    """An OpenAPI v3 structural schema with every object that lists its properties closed (additionalProperties
    false, unless it preserves unknown fields): the API server's strict field validation (`kubectl apply
    --validate=strict`) refuses unknown fields rather than pruning them silently."""
    s = dict(schema)
    if "properties" in s:
        s["properties"] = {k: _strict(v) for k, v in s["properties"].items()}
        if "additionalProperties" not in s and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
    if isinstance(s.get("items"), dict):
        s["items"] = _strict(s["items"])
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = _strict(s["additionalProperties"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in s:
            s[key] = [_strict(x) for x in s[key]]
    return s


def _crds() -> dict[str, tuple[str, dict]]:
    """kind -> (apiVersion, strict schema) of the operator's CRDs of the resources dagrl creates, as dask-kubernetes
    ships them (its Helm chart's crds/), read once."""
    dk = pytest.importorskip("dask_kubernetes", reason="the CRDs ship with dask-kubernetes: pip install -e "
                                                       "'.[kubernetes]'")
    pytest.importorskip("jsonschema")
    return _read_crds(Path(dk.__file__).parent / "operator/deployment/helm/dask-kubernetes-operator/crds")


@functools.lru_cache(maxsize=1)
def _read_crds(folder: Path) -> dict[str, tuple[str, dict]]:
    out = {}
    for name in ("daskcluster", "daskworkergroup"):
        crd = yaml.load((folder / f"{name}.yaml").read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        for v in crd["spec"]["versions"]:
            if v.get("served") and v.get("storage"):
                out[crd["spec"]["names"]["kind"]] = (f"{crd['spec']['group']}/{v['name']}",
                                                     _strict(v["schema"]["openAPIV3Schema"]))
    assert {"DaskCluster", "DaskWorkerGroup"} <= set(out), out.keys()
    return out


def crd_errors(resource: dict, crds: dict) -> list[str]:
    """Why the operator's API would refuse `resource` (empty: it would accept it)."""
    import jsonschema
    kind = resource.get("kind")
    if kind not in crds:
        return [f"kind {kind!r} is no CRD of the operator ({sorted(crds)})"]
    api_version, schema = crds[kind]
    errors = [] if resource.get("apiVersion") == api_version else [f"apiVersion {resource.get('apiVersion')}"]
    name = (resource.get("metadata") or {}).get("name", "")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
        errors.append(f"metadata.name {name!r}")
    body = {k: v for k, v in resource.items() if k not in ("apiVersion", "kind", "metadata")}
    validator = jsonschema.Draft7Validator(schema)
    errors += [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
    return errors


# ----- the placement: the workers the resources would register -----

def registered_workers(cfg, resources: list[dict], seed: int = 0) -> dict:
    """scheduler_info()["workers"] of the pods `resources` start: each env pod one worker (its name the operator's
    `<group>-worker-<uuid>`, its args' resource); each GPU pod under `dask cuda worker` one worker per GPU of its
    limits, named `<pod>-i` when there are several (dask_cuda.cuda_worker: `name + "-" + str(i)`), else one worker.
    Pods get distinct addresses (a pod has its own IP); the uuids are random, as the operator's are."""
    rng = random.Random(seed)
    workers = {}
    for r, resource in enumerate(resources):
        group = resource["metadata"]["name"] + ("-default" if resource["kind"] == "DaskCluster" else "")
        worker = resource["spec"]["worker"]
        (container,) = worker["spec"]["containers"]
        args = container["args"]
        res = dict(kv.split("=") for kv in args[args.index("--resources") + 1].split())
        gpus = int(container["resources"]["limits"].get(cfg.cluster.gpu_resource, "0"))
        per_pod = gpus if args[:3] == ["dask", "cuda", "worker"] else 1
        for p in range(worker["replicas"]):
            pod = f"{group}-worker-{rng.getrandbits(40):010x}"
            for i in range(per_pod):
                workers[f"tcp://10.{r}.{p // 250}.{p % 250 + 1}:{40000 + i}"] = {
                    "name": pod if per_pod == 1 else f"{pod}-{i}", "resources": {k: float(v) for k, v in res.items()},
                    "nthreads": int(args[args.index("--nthreads") + 1])}
    return workers


PLACEMENTS = {
    "default": [],
    "one pod of 2 GPUs, 2 actor ranks": ["cluster.gpus_per_worker=2", "algorithm.num_actor_ranks=2",
                                         "cluster.component_placement.actor=0-1"],
    "4 GPUs in 2 pods, env on all": ["cluster.num_gpus=4", "cluster.gpus_per_worker=2",
                                     "cluster.component_placement.env=0-3"],
    "disaggregated on 2 one-GPU pods": ["rollout.inference=disaggregated", "cluster.num_gpus=2",
                                        "cluster.component_placement.actor=0", "cluster.component_placement.rollout=1",
                                        "cluster.component_placement.env=1"],
    "logical GPU workers": ["cluster.gpus_per_worker=0", "cluster.gpu_worker_command=dask", "cluster.num_gpus=2",
                            "cluster.env_pods=3", "policy.device=cpu"],
}


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_the_workers_of_the_resources_hold_the_placement(name):
    """The offline check (the devices the kind derives) and the live planning on the workers the pods would
    register agree: n GPU workers with GPU=1 (pods x GPUs per pod under dask cuda worker), the env (CPU=1) workers
    the config asks for, the same device sets, one actor worker per rank, and the env workers serving the devices
    `env_served` said they would."""
    cfg = _cfg(*PLACEMENTS[name], components=True)
    cp = check_placement(cfg, cuda_count=0)
    n = cp.num_devices
    resources = spec.cluster_resources(cfg, n)
    workers = registered_workers(cfg, resources)
    gpu_w = sorted((a for a, w in workers.items() if w["resources"].get("GPU") == 1),
                   key=lambda a: natural_order(workers[a]["name"]))
    env_w = sorted((a for a, w in workers.items() if w["resources"].get("CPU") == 1),
                   key=lambda a: natural_order(workers[a]["name"]))
    assert len(gpu_w) == n and len(gpu_w) + len(env_w) == len(workers)
    want_env = cfg.cluster.env_pods or n
    assert len(env_w) == want_env
    live = plan_placement(cfg, {"workers": workers})
    assert live.devices == cp.devices and live.mode == cp.mode
    assert len(live.actor_workers) == len(cp.devices["actor"]) >= cfg.algorithm.num_actor_ranks
    assert sorted(pc.kind_of(cfg).env_served(cfg, n)) == sorted(_env_devices(env_w, gpu_w).values())
    assert pc.rejoin(cfg) == (len(workers), cfg.cluster.start_timeout_s)
    g = cfg.cluster.gpus_per_worker
    (gpu_container,) = resources[1]["spec"]["worker"]["spec"]["containers"]
    assert gpu_container["resources"]["limits"].get(cfg.cluster.gpu_resource) == (str(g) if g else None)
    assert resources[1]["spec"]["worker"]["replicas"] == (n // g if g else n)


def test_resources_pass_the_operators_crds():
    """Every placement's DaskCluster and DaskWorkerGroup pass the operator's CRD schemas (strict); the validator
    itself refuses a misspelt field, a quantity given as a number and a missing container image."""
    crds = _crds()
    for name, overrides in PLACEMENTS.items():
        gpu = ["+cluster.gpu_node_selector.gpu=h100"] if "cluster.gpus_per_worker=0" not in overrides else []
        cfg = _cfg(*overrides, *gpu, "cluster.namespace=rl", "+cluster.pod_env.HF_HOME=/dagrl/runs/hf")
        n = pc.num_devices(cfg, 0)[0]
        for r in spec.cluster_resources(cfg, n):
            assert crd_errors(r, crds) == [], (name, r["kind"], crd_errors(r, crds))
    good = spec.cluster_resources(_cfg(), 1)[1]
    container = lambda r: r["spec"]["worker"]["spec"]["containers"][0]  # noqa: E731
    bad = copy.deepcopy(good)
    container(bad)["resource"] = container(bad).pop("resources")
    assert any("resource" in e for e in crd_errors(bad, crds))
    bad = copy.deepcopy(good)
    container(bad)["resources"]["limits"]["nvidia.com/gpu"] = 1
    assert any("is not of type 'string'" in e for e in crd_errors(bad, crds))
    bad = copy.deepcopy(good)
    del container(bad)["name"]
    assert any("'name' is a required property" in e for e in crd_errors(bad, crds))


def test_the_scheduler_is_dask_kubernetes_own_and_the_workers_join_it():
    """The scheduler's Service, ports and probes are dask-kubernetes' `make_scheduler_spec`'s; the workers' args
    carry make_worker_spec's name and dashboard arguments (the operator sets DASK_WORKER_NAME and
    DASK_SCHEDULER_ADDRESS in every worker pod, so no scheduler address is given); the resources are what
    `KubeCluster(custom_cluster_spec=...)` and `add_worker_group(custom_spec=...)` create (names, namespace)."""
    op = pytest.importorskip("dask_kubernetes.operator", reason="pip install -e '.[kubernetes]'")
    cfg = _cfg("cluster.name=rl-run", "cluster.namespace=rl", "cluster.service_type=LoadBalancer")
    dc, wg = spec.cluster_resources(cfg, 1)
    theirs = op.make_scheduler_spec(cluster_name="rl-run", scheduler_service_type="LoadBalancer")
    assert dc["spec"]["scheduler"]["service"] == theirs["service"]
    (mine,), (their,) = dc["spec"]["scheduler"]["spec"]["containers"], theirs["spec"]["containers"]
    for key in ("name", "ports", "readinessProbe", "livenessProbe"):
        assert mine[key] == their[key], key
    their_worker = op.make_worker_spec(worker_command="dask worker")["spec"]["containers"][0]["args"]
    for group in (dc["spec"]["worker"], wg["spec"]["worker"]):
        (c,) = group["spec"]["containers"]
        tail = their_worker[2:]  # ["--name", "$(DASK_WORKER_NAME)", "--dashboard", "--dashboard-address", "8788"]
        assert all(a in c["args"] for a in tail) and not any(a.startswith("tcp://") for a in c["args"])
        assert not {e["name"] for e in c["env"]} & set(spec.OPERATOR_ENV)
    assert (dc["metadata"]["name"], dc["metadata"]["namespace"]) == ("rl-run", "rl")
    assert wg["metadata"] == {"name": f"rl-run-{spec.GPU_GROUP}", "namespace": "rl"} and wg["spec"]["cluster"] == "rl-run"


# ----- deploy/ -----

def core_errors(resource: dict) -> list[str]:
    """Why the API server would refuse a core resource (Job, Role, PersistentVolumeClaim, ...): the Kubernetes
    client's model of its kind (pydantic, extra fields forbidden) validating it: unknown fields, wrong types,
    missing required fields."""
    kc = pytest.importorskip("kubernetes.client", reason="the models ship with kubernetes (the kubernetes extra)")
    import pydantic
    try:
        getattr(kc, f"V1{resource['kind']}").model_validate(resource)
    except pydantic.ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


def _header_overrides(text: str) -> list[str]:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("# generated by: python -m pipelines.validate ")]
    return line.removeprefix("# generated by: python -m pipelines.validate ").split()


def test_deploy_cluster_manifest_is_what_the_kind_creates():
    """deploy/dagrl-cluster.yaml (for users who apply it themselves) is exactly the kind's resources for the
    overrides its header names, and passes the operator's CRDs."""
    text = (DEPLOY / "dagrl-cluster.yaml").read_text()
    overrides = _header_overrides(text)
    cfg = load_config(overrides, components=True, notes=[])[0]
    assert list(yaml.safe_load_all(text)) == spec.cluster_resources(cfg, pc.num_devices(cfg, 0)[0])
    crds = _crds()  # skips here without dask-kubernetes (the equality above needs none)
    for r in yaml.safe_load_all(text):
        assert crd_errors(r, crds) == []


def test_deploy_driver_and_volume():
    """deploy/driver.yaml and runs-pvc.yaml pass the Kubernetes models; the Job's command is a config that passes
    every offline check; it mounts the claim its command names at the mount path run_root resolves to from its
    working directory, runs the image it gives the cluster, under a service account whose Role allows what
    KubeCluster does (create and delete DaskClusters and DaskWorkerGroups, read pods and services)."""
    docs = list(yaml.safe_load_all((DEPLOY / "driver.yaml").read_text()))
    (pvc,) = yaml.safe_load_all((DEPLOY / "runs-pvc.yaml").read_text())
    for r in [*docs, pvc]:
        assert core_errors(r) == [], (r["kind"], core_errors(r))
    by_kind = {r["kind"]: r for r in docs}
    typo = copy.deepcopy(by_kind["Job"])  # the check can fail: a misspelt field, a port as text
    typo["spec"]["template"]["spec"]["containers"][0]["workDir"] = "/dagrl"
    typo["spec"]["template"]["spec"]["containers"][0]["ports"] = [{"containerPort": "http"}]
    assert len(core_errors(typo)) == 2, core_errors(typo)
    pod = by_kind["Job"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][:3] == ["python", "-m", "pipelines.run"]
    cfg = load_config(c["args"][3:], components=False, notes=[])[0]
    assert type(cfg.cluster) is family_class("cluster", "kubernetes") and cfg.cluster.image == c["image"]
    claim = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: claim[m["name"]] for m in c["volumeMounts"]}
    assert mounts.get(cfg.cluster.runs_mount_path) == cfg.cluster.runs_volume_claim == pvc["metadata"]["name"]
    run_root = str(Path(c["workingDir"], cfg.run_root))
    assert run_root == cfg.cluster.runs_mount_path or run_root.startswith(cfg.cluster.runs_mount_path + "/")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    assert pod["serviceAccountName"] == by_kind["ServiceAccount"]["metadata"]["name"]
    binding = by_kind["RoleBinding"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    allowed = {(g, r, v) for rule in by_kind["Role"]["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    need = ([("kubernetes.dask.org", r, v) for r in ("daskclusters", "daskworkergroups")
             for v in ("get", "list", "create", "patch", "delete")]
            + [("", r, v) for r in ("pods", "services") for v in ("get", "list", "watch")])
    assert set(need) <= allowed, set(need) - allowed


# ----- bad settings -----

@pytest.mark.parametrize("overrides, key, fix", [
    (["cluster.image=null"], "cluster.image", "docker build"),
    (["cluster.runs_volume_claim=null"], "cluster.runs_volume_claim", "ReadWriteMany PersistentVolumeClaim"),
    (["cluster.gpu_worker_command=dask", "cluster.gpus_per_worker=2"], "cluster.gpus_per_worker",
     "cluster.gpu_worker_command=cuda"),
    (["cluster.gpus_per_worker=0"], "cluster.gpus_per_worker", "cluster.gpu_worker_command=dask"),
    (["cluster.gpus_per_worker=0", "cluster.gpu_worker_command=dask", "policy.device=cuda"],
     "cluster.gpus_per_worker", "policy.device=cpu"),
    (["cluster.num_gpus=3", "cluster.gpus_per_worker=2"], "cluster.num_gpus", "multiple of 2"),
    (["cluster.env_worker_memory=4GiB"], "cluster.env_worker_memory", "no 'B'"),
    (["cluster.gpu_worker_memory_limit=16Gi"], "cluster.gpu_worker_memory_limit", "below its request"),
    (["cluster.name=Dagrl_Run"], "cluster.name", "lowercase"),
    (["cluster.service_type=Ingress"], "cluster.service_type", "LoadBalancer"),
    (["run_root=/tmp/dagrl-elsewhere"], "run_root", "cluster.runs_mount_path"),
    (["+cluster.pod_env.DASK_WORKER_NAME=w"], "cluster.pod_env.DASK_WORKER_NAME", "operator sets it"),
    (["cluster.security.temporary=true"], "cluster.security", "cluster=address"),
    (["cluster.env_worker_memory=2Gi"], "cluster.env_worker_memory", "cluster.memory_limit=3GiB"),
    (["cluster.num_gpus=4", "cluster.gpus_per_worker=4", "cluster.memory_limit=9GiB", "cluster.env_worker_memory=9Gi"],
     "cluster.gpu_worker_memory", "at least 36Gi"),  # 4 Dask workers (one per GPU) of 9 GiB in one pod of 32Gi
])
def test_bad_settings_are_refused_with_the_key_and_the_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert err.value.key == key and fix in err.value.fix and "\n" not in str(err.value), err.value


def test_quantities_as_kubernetes_reads_them():
    """k8s.io/apimachinery resource.Quantity: binary suffixes are powers of 2^10, decimal ones of 10^3, m is milli,
    an e/E followed by digits an exponent; anything else is no quantity."""
    q = spec.parse_quantity
    assert (q("500m"), q("1"), q("2.5")) == (0.5, 1.0, 2.5)
    assert (q("4Gi"), q("512Mi"), q("1Ki")) == (4 * 1024 ** 3, 512 * 1024 ** 2, 1024)
    assert (q("4G"), q("1k"), q("1e3"), q("2E")) == (4e9, 1e3, 1e3, 2e18)
    assert [q(t) for t in ("4GiB", "4 Gi", "-1", "Gi", "1.2.3", "")] == [None] * 6


# ----- validate, and starting without a cluster -----

def test_validate_prints_the_resources_without_any_kubernetes_client(tmp_path, monkeypatch, capsys):
    """`pipelines.validate cluster=kubernetes ...` prints the resources (indented YAML after the cluster line),
    with dask-kubernetes and kr8s unimportable: nothing can have contacted a cluster."""
    from pipelines.validate import main
    for mod in ("kr8s", "dask_kubernetes", "kubernetes"):
        monkeypatch.setitem(sys.modules, mod, None)
    runs = tmp_path / "runs"
    args = [*BASE, f"cluster.runs_mount_path={runs}", f"run_root={runs}", "cluster.num_gpus=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("  cluster: kubernetes, DaskCluster dagrl"))
    body = [ln[4:] for ln in lines[start + 1:] if ln.startswith("    ")]
    cfg = load_config(args, components=False, notes=[])[0]
    assert list(yaml.safe_load_all("\n".join(body))) == spec.cluster_resources(cfg, 2)
    assert "2 env workers (CPU) + 2 GPU pods x 1 nvidia.com/gpu (dask cuda worker) = 2 GPU workers" in lines[start]


def test_without_dask_kubernetes_starting_says_which_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "dask_kubernetes.operator", None)
    cfg = _cfg(f"cluster.runs_mount_path={tmp_path}", f"run_root={tmp_path}")
    with pytest.raises(ConnectionError, match=r"^cluster\.kind=kubernetes needs dask-kubernetes.*\[kubernetes\]"):
        k8s.start(cfg)


@pytest.mark.parametrize("kubeconfig", ["missing", "closed port"])
def test_no_reachable_kubernetes_is_one_line_naming_the_kind(kubeconfig, monkeypatch, tmp_path):
    """No kubeconfig, or one whose API server does not answer: ConnectionError in one line naming cluster.kind and
    the fix (KUBECONFIG), before anything is created."""
    pytest.importorskip("dask_kubernetes.operator", reason="pip install -e '.[kubernetes]'")
    import socket
    path = tmp_path / "kubeconfig"
    if kubeconfig == "closed port":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed again when the block ends: connections are refused
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}",
                                                   "insecure-skip-tls-verify": True}}],
            "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "rl"}}],
            "users": [{"name": "u", "user": {"token": "t"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = _cfg(f"cluster.runs_mount_path={tmp_path}", f"run_root={tmp_path}")
    with pytest.raises(ConnectionError) as err:
        k8s.start(cfg)
    msg = str(err.value)
    assert msg.startswith("cluster.kind=kubernetes: no Kubernetes API reachable (") and "\n" not in msg, msg
    assert "KUBECONFIG" in msg and "cluster.kind=local" in msg


@pytest.mark.cluster  # a `python -m pipelines.run` process (the tier guard counts it; no cluster starts)
def test_run_without_kubernetes_exits_2_with_one_line(tmp_path):
    pytest.importorskip("dask_kubernetes.operator", reason="pip install -e '.[kubernetes]'")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none"),
           "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "pipelines.run", "conf=smoke", *BASE,
                          f"cluster.runs_mount_path={tmp_path}", f"run_root={tmp_path}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith("error: cluster.kind=kubernetes: no Kubernetes API reachable"), errors


def test_pod_reasons_name_what_keeps_each_pod():
    """From the pods' status: the scheduler's message for an unschedulable pod, a container's waiting reason, and
    nothing for a running, ready pod."""
    pods = [
        {"metadata": {"name": "a"}, "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}},
        {"metadata": {"name": "b"}, "status": {"phase": "Pending", "containerStatuses": [
            {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "pull access denied"}}}]}},
        {"metadata": {"name": "c"}, "status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"}]}},
    ]
    assert k8s.pod_reasons(pods) == ["a: Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                                     "b: ImagePullBackOff: pull access denied"]


# ----- start, with the operator played by an in-process Dask cluster -----

def _stand_in(monkeypatch, joins: bool = True):
    """KubeCluster played by a SpecCluster of in-process workers: each pod of the DaskCluster's default group and,
    once `add_worker_group` is called, of the GPU group becomes the workers it would run (`registered_workers`:
    names, resources, threads); with `joins=False` the GPU group's pods never start. Records what was created."""
    pytest.importorskip("dask_kubernetes.operator", reason="pip install -e '.[kubernetes]'")
    from distributed import Scheduler, SpecCluster, Worker

    from dask_kubernetes.operator.kubecluster import kubecluster as kc_module
    log: dict = {"closed": 0}

    def workers_of(cfg, resource):
        return {w["name"]: {"cls": Worker, "options": {"name": w["name"], "resources": w["resources"],
                                                      "nthreads": w["nthreads"]}}
                for w in registered_workers(cfg, [resource]).values()}

    class StandIn(SpecCluster):
        def __init__(self, *, custom_cluster_spec, namespace, create_mode, shutdown_on_close, resource_timeout,
                     quiet):
            log.update(cluster=custom_cluster_spec, namespace=namespace, create_mode=create_mode.name,
                       shutdown_on_close=shutdown_on_close)
            super().__init__(workers=workers_of(log["cfg"], custom_cluster_spec),
                             scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}})

        def add_worker_group(self, name, custom_spec=None, **kw):
            log["group"] = (name, custom_spec)
            if joins:
                self.worker_spec.update(workers_of(log["cfg"], {"kind": "DaskWorkerGroup", "metadata": {
                    "name": f"{log['cluster']['metadata']['name']}-{name}"}, "spec": {"worker": custom_spec}}))
                self.sync(self._correct_state)

        def close(self, timeout=None):
            log["closed"] += 1
            return super().close(timeout=timeout)

    monkeypatch.setattr(kc_module, "KubeCluster", StandIn)
    monkeypatch.setattr(k8s, "connect_api", lambda cfg: type("Api", (), {"namespace": "rl"})())
    return log


@pytest.mark.cluster  # an in-process Dask cluster stands in for the operator's pods
def test_start_creates_the_resources_and_plans_on_their_workers(monkeypatch, tmp_path):
    """start(): KubeCluster(custom_cluster_spec=the DaskCluster, create-only, deleted on close) in the kubeconfig's
    namespace, the GPU group added with its worker spec, every worker waited for; the placement plans on them as
    offline; closing the handle closes (deletes) the cluster."""
    log = _stand_in(monkeypatch)
    cfg = _cfg(*PLACEMENTS["4 GPUs in 2 pods, env on all"], f"cluster.runs_mount_path={tmp_path}",
               f"run_root={tmp_path}")
    log["cfg"] = cfg
    dc, wg = spec.cluster_resources(cfg, 4)
    handle = k8s.start(cfg)
    try:
        assert log["cluster"] == dc and log["namespace"] == "rl"
        assert (log["create_mode"], log["shutdown_on_close"]) == ("CREATE_ONLY", True)
        assert log["group"] == (spec.GPU_GROUP, wg["spec"]["worker"])
        live = plan_placement(cfg, handle.client)
        assert len(live.gpu_workers) == 4 and len(live.env_workers) == 4
        assert live.devices == check_placement(cfg, cuda_count=0).devices
    finally:
        handle.close()
    assert log["closed"] == 1


@pytest.mark.cluster
def test_start_gives_up_in_one_line_naming_the_pods_and_deletes_the_cluster(monkeypatch, tmp_path):
    """GPU pods that never start (no GPU node free): after cluster.start_timeout_s one line with the workers that
    joined, each pod not running and why (from the pods' status), the fix; the DaskCluster is deleted."""
    import kr8s
    log = _stand_in(monkeypatch, joins=False)
    cfg = _cfg("cluster.start_timeout_s=3", f"cluster.runs_mount_path={tmp_path}", f"run_root={tmp_path}")
    log["cfg"] = cfg
    pending = {"metadata": {"name": "dagrl-gpu-worker-0a1b2c3d4e"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]}}
    asked = []

    def get(kind, namespace=None, label_selector=None):
        asked.append((kind, namespace, label_selector))
        return [type("Pod", (), {"raw": pending})()]
    monkeypatch.setattr(kr8s, "get", get)
    with pytest.raises(ConnectionError) as err:
        k8s.start(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("cluster.start_timeout_s=3: 1 of 2 workers joined"), msg
    assert "dagrl-gpu-worker-0a1b2c3d4e: Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu." in msg
    assert asked == [("pods", "rl", {"dask.org/cluster-name": "dagrl"})] and log["closed"] == 1
