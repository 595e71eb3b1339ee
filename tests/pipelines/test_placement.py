"""Component placement (RLinf's `cluster.component_placement`): the parser, the modes, the rejections a config or a
cluster gets before anything is submitted (each with the numbers), and `plan_placement` on fake `scheduler_info`
dicts (no cluster is started), and the environment the embedded cluster spawns its workers with (the one test
that starts a cluster: the smoke config's two workers)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import graphs
from pipelines.clusters import (PlacementError, check_graph, check_placement, parse_component_placement, parse_devices,
                                plan_placement)
from pipelines.clusters.checks import check_local
from pipelines.clusters.local import _worker_env, gpu_worker_specs
from tasks.config import Config, ConfigError, check_config, family_class, replace_key, replace_keys

REPO = Path(__file__).resolve().parents[2]
KEY = "cluster.component_placement.actor"


def config(placement: dict | None = None, *, num_shards: int = 2, kind: str = "local", **cluster) -> Config:
    cfg = replace_key(Config(), "cluster", family_class("cluster", kind)())
    cfg = replace_keys(cfg, {"env.num_envs": 8, "env.num_shards": num_shards, "rollout.chunk_steps": 4,
                             "rollout.chunk_steps_per_node": 2, "algorithm.num_minibatches": 2,
                             "cluster.component_placement": {**cfg.cluster.component_placement, **(placement or {})},
                             **{f"cluster.{k}": v for k, v in cluster.items()}})
    return check_config(cfg)


def info(n_env: int, n_gpu: int, *, host: str = "127.0.0.1", start: int = 40000, **extra) -> dict:
    """A `client.scheduler_info()` dict: env-i workers with CPU=1, gpu-i workers with GPU=1 (listed in reverse,
    so nothing depends on the dict's order)."""
    workers = {f"tcp://{host}:{start + i}": {"name": f"env-{i}", "resources": {"CPU": 1}} for i in range(n_env)}
    workers.update({f"tcp://{host}:{start + 100 + i}": {"name": f"gpu-{i}", "resources": {"GPU": 1}}
                    for i in range(n_gpu)})
    workers.update(extra)
    return {"workers": dict(reversed(list(workers.items())))}


def env_addr(i, host="127.0.0.1", start=40000):
    return f"tcp://{host}:{start + i}"


def gpu_addr(i, host="127.0.0.1", start=40000):
    return f"tcp://{host}:{start + 100 + i}"


# ----- the parser -----

@pytest.mark.parametrize("spec, n, devices", [
    ("all", 4, (0, 1, 2, 3)),
    ("ALL", 1, (0,)),
    ("2", 4, (2,)),
    (3, 4, (3,)),  # YAML `actor: 3` arrives as an int before the schema makes it a string
    ("0-3", 4, (0, 1, 2, 3)),
    ("0,2", 4, (0, 2)),
    ("0-1,3", 4, (0, 1, 3)),
    ("3,0-1", 4, (0, 1, 3)),
    (" 1 - 2 , 0 ", 3, (0, 1, 2)),
    ("all", None, None),  # size unknown (remote cluster, offline): syntax only
    ("0-7", None, tuple(range(8))),
])
def test_parse_devices(spec, n, devices):
    assert parse_devices(KEY, spec, n) == devices


@pytest.mark.parametrize("spec, words", [
    ("3-1", "range 3-1 runs backwards; write 1-3"),
    ("0-2,1", "device 1 is listed twice ('0-2' and '1' overlap)"),
    ("0-2,2-3", "device 2 is listed twice ('0-2' and '2-3' overlap)"),
    ("x", "'x' is not a device index or range; use 'all', 'N', 'A-B', 'A,B' or 'A-B,C'"),
    ("-1", "'-1' is not a device index"),
    ("0-", "'0-' is not a device index"),
    ("0,,1", "'' is not a device index"),
    ("1-2-3", "'1-2-3' is not a device index"),
])
def test_parse_devices_rejects_malformed_specs(spec, words):
    with pytest.raises(ConfigError) as err:
        parse_devices(KEY, spec, 8)
    msg = str(err.value)
    assert msg.startswith(f"{KEY}={spec!r}: ") and words in msg and "\n" not in msg


def test_device_index_beyond_the_cluster_names_the_numbers():
    with pytest.raises(ConfigError) as err:
        parse_devices(KEY, "2-3", 2, "cluster.num_gpus=2")
    assert str(err.value) == (f"{KEY}='2-3': needs 4 GPUs, the cluster has 2 (cluster.num_gpus=2); use devices 0-1 "
                              "or 'all', or a cluster with more GPUs")


@pytest.mark.parametrize("spec, n, devices, mode", [
    ({}, 1, {"actor": (0,), "env": (0,), "rollout": (0,)}, "colocated"),  # today's behaviour
    ({"actor": "", "env": "", "rollout": ""}, 1, {"actor": (0,), "env": (0,), "rollout": (0,)}, "colocated"),
    ({}, 2, {"actor": (0,), "env": (0, 1), "rollout": (0,)}, "hybrid"),
    ({"actor,env,rollout": "all"}, 4, {c: (0, 1, 2, 3) for c in ("actor", "env", "rollout")}, "colocated"),
    ({"actor, env": "0-1", "rollout": "0-1"}, 2, {c: (0, 1) for c in ("actor", "env", "rollout")}, "colocated"),
    ({"actor": "0-1", "env": "2", "rollout": "3"}, 4, {"actor": (0, 1), "env": (2,), "rollout": (3,)},
     "disaggregated"),
    ({"actor": "0-3", "env": "0-1", "rollout": "2-3"}, 4,  # RLinf's embodied example
     {"actor": (0, 1, 2, 3), "env": (0, 1), "rollout": (2, 3)}, "hybrid"),
    ({"actor": "1"}, 2, {"actor": (1,), "env": (0, 1), "rollout": (1,)}, "hybrid"),  # rollout follows the actor
])
def test_component_placement_and_mode(spec, n, devices, mode):
    cp = parse_component_placement(spec, n)
    assert cp.devices == devices and cp.mode == mode and cp.num_devices == n


@pytest.mark.parametrize("spec, key, words", [
    ({"critic": "0"}, "cluster.component_placement.critic", "unknown component 'critic'; known: ['actor', 'env', "
                                                            "'rollout']"),
    ({"actor,critic": "0"}, "cluster.component_placement.actor,critic", "unknown component 'critic'"),
    ({"actor": "0", "actor,env": "1"}, "cluster.component_placement.actor,env",
     "component 'actor' is placed twice (also by cluster.component_placement.actor)"),
])
def test_component_placement_rejects_unknown_and_double_components(spec, key, words):
    with pytest.raises(ConfigError) as err:
        parse_component_placement(spec, 4)
    assert str(err.value).startswith(key + "=") and words in str(err.value)


def test_config_validate_checks_the_new_fields():
    with pytest.raises(ConfigError, match=r"^cluster\.component_placement\.critic='0': unknown component"):
        config({"critic": "0"})
    with pytest.raises(ConfigError, match=r"^cluster\.num_gpus=0: must be >= 1"):
        config(num_gpus=0)


# ----- rejections before submission, with the numbers -----

def test_four_gpus_on_a_one_gpu_cluster_is_rejected_offline():
    cfg = config({"actor": "0-3"})  # num_gpu_workers=1, num_gpus null
    with pytest.raises(ConfigError) as err:
        check_placement(cfg, cuda_count=0)
    assert str(err.value).startswith(f"{KEY}='0-3': needs 4 GPUs, the cluster has 1 (cluster.num_gpu_workers=1, "
                                     "no CUDA device)")
    with pytest.raises(ConfigError, match=r"needs 4 GPUs, the cluster has 1 \(cluster\.num_gpus=1\)"):
        check_placement(config({"actor": "0-3"}, num_gpus=1), cuda_count=8)
    with pytest.raises(ConfigError, match=r"needs 4 GPUs, the cluster has 2 \(2 CUDA devices\)"):
        check_placement(cfg, cuda_count=2)
    # the embedded cluster refuses before starting a worker
    with pytest.raises(ConfigError, match="needs 4 GPUs, the cluster has 1"):
        gpu_worker_specs(cfg, 0)
    # a remote cluster of unknown size: syntax only, the numbers once connected
    remote = config({"actor": "0-3"}, kind="address", address="tcp://10.0.0.1:8786")
    remote = replace_key(remote, "algorithm.num_actor_ranks", 4)  # (4 actor devices with one rank would leave 3 idle: refused, below)
    assert check_placement(remote, cuda_count=0) is None
    with pytest.raises(ConfigError, match="runs backwards"):
        check_placement(config({"actor": "3-0"}, kind="address", address="tcp://10.0.0.1:8786"), cuda_count=0)


def test_four_gpus_on_a_one_gpu_cluster_is_rejected_by_plan_placement():
    with pytest.raises(PlacementError) as err:
        plan_placement(config({"actor": "0-3"}, num_gpu_workers=4), info(2, 1))
    assert str(err.value).startswith(f"{KEY}='0-3': needs 4 GPUs, the cluster has 1 (1 GPU worker in the cluster)")
    with pytest.raises(PlacementError, match=r"^cluster\.num_gpus=4: the cluster has 1 GPU workers \(resource GPU\) "
                                             r"among 3 workers"):
        plan_placement(config(num_gpus=4), info(2, 1))


@pytest.mark.slow  # a subprocess CLI run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_validate_cli_rejects_four_gpus_on_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "pipelines.validate", "conf=smoke", "cluster.num_gpus=1",
                           "cluster.component_placement.actor=0-3"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {KEY}='0-3': needs 4 GPUs, the cluster has 1 (cluster.num_gpus=1); use devices 0 or 'all', "
        "or a cluster with more GPUs"]


def test_a_resource_no_worker_has_is_rejected():
    # the cluster lacks GPU workers altogether
    with pytest.raises(PlacementError, match=r"^cluster='2 workers, none with resource GPU'"):
        plan_placement(config(), info(2, 0))
    with pytest.raises(PlacementError, match=r"^cluster='1 workers, none with resource CPU'"):
        plan_placement(config(), info(0, 1))
    # a graph node annotated with a resource no worker has (it would wait forever in `no-worker`)
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
    hlg = HighLevelGraph({"infer-x-0": MaterializedLayer({"infer-x-0": (len, [])}, annotations={"resources": {"TPU": 1}})},
                         {"infer-x-0": set()})
    with pytest.raises(PlacementError) as err:
        check_graph(hlg, info(2, 1))
    assert str(err.value) == ("cluster='TPU=1': node infer-x-0 needs resource TPU=1, none of the 3 workers has it "
                              "(CPU=1 on 2 workers, GPU=1 on 1 worker); start a worker with `--resources TPU=1` or "
                              "drop the annotation")
    # more of a resource than any worker has
    hlg = HighLevelGraph({"u": MaterializedLayer({"u": (len, [])}, annotations={"resources": {"GPU": 2}})}, {"u": set()})
    with pytest.raises(PlacementError, match="needs resource GPU=2, none of the 3 workers"):
        check_graph(hlg, info(2, 1))
    # pinned to a worker without the resource, or to one that is gone
    hlg = HighLevelGraph({"u": MaterializedLayer({"u": (len, [])}, annotations={
        "workers": [env_addr(0)], "allow_other_workers": False, "resources": {"GPU": 1}})}, {"u": set()})
    with pytest.raises(PlacementError, match=rf"node u is pinned to \['{env_addr(0)}'\], without resource GPU=1 "
                                             r"\(1 of the 3 workers have it\)"):
        check_graph(hlg, info(2, 1))
    hlg = HighLevelGraph({"u": MaterializedLayer({"u": (len, [])}, annotations={"workers": ["tcp://gone:1"]})},
                         {"u": set()})
    with pytest.raises(PlacementError, match="pinned to worker\\(s\\) not in the cluster \\(3 workers"):
        check_graph(hlg, info(2, 1))


def test_num_minibatches_not_dividing_the_batch_names_the_numbers():
    """Checked in tasks/config.py (`Config.validate`); tests/pipelines/test_config.py has it through Hydra too."""
    cfg = replace_key(Config(), "algorithm.num_minibatches", 7)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == ("algorithm.num_minibatches=7: must divide the batch of rollout.chunk_steps*env.num_envs="
                              "1600 samples")


def test_env_devices_without_env_workers_are_rejected():
    cfg = config({"actor": "0-1", "rollout": "2", "env": "3"}, num_gpus=4)  # 2 env workers serve devices 0, 1
    msg = ("cluster.component_placement.env='3': no env (CPU) worker serves devices 3: the 2 env workers serve "
           "devices 0-1; add env workers (one per device: cluster.num_env_workers=4) or place env on those devices")
    with pytest.raises(PlacementError) as err:
        check_placement(cfg, cuda_count=0)
    assert str(err.value) == msg
    with pytest.raises(PlacementError) as err:
        plan_placement(cfg, info(2, 4))
    assert str(err.value) == msg


# ----- plan_placement on fake clusters -----

def test_default_placement_is_todays_behaviour():
    p = plan_placement(config(num_shards=4), info(2, 1))
    assert p.shard_workers == [env_addr(0), env_addr(1), env_addr(0), env_addr(1)]
    assert p.actor_worker == p.rollout_worker == gpu_addr(0)
    assert p.env_workers == [env_addr(0), env_addr(1)] and p.gpu_workers == [gpu_addr(0)]
    assert p.mode == "colocated" and p.devices == {"actor": (0,), "env": (0,), "rollout": (0,)}
    assert p.annotations("env", 3) == {"workers": [env_addr(1)], "allow_other_workers": False,
                                       "resources": {"CPU": 1}}
    assert p.annotations("actor") == {"workers": [gpu_addr(0)], "allow_other_workers": False,
                                      "resources": {"GPU": 1}}
    assert p.annotations("rollout") == p.annotations("actor")


def test_plan_colocated():
    p = plan_placement(config({"actor,env,rollout": "all"}, num_shards=4), info(4, 2))
    assert p.mode == "colocated"
    assert p.actor_workers == p.rollout_workers == [gpu_addr(0), gpu_addr(1)]
    assert p.actor_worker == gpu_addr(0)
    assert p.shard_workers == [env_addr(i) for i in range(4)]


def test_plan_disaggregated():
    cfg = config({"actor": "0-1", "rollout": "2", "env": "3"}, num_shards=4, num_env_workers=8)
    p = plan_placement(cfg, info(8, 4))
    assert p.mode == "disaggregated"
    assert p.actor_workers == [gpu_addr(0), gpu_addr(1)] and p.actor_worker == gpu_addr(0)
    assert p.rollout_worker == gpu_addr(2) and p.rollout_workers == [gpu_addr(2)]
    # env workers serve devices round-robin (env-j -> device j % 4): device 3 has env-3 and env-7
    assert p.shard_workers == [env_addr(3), env_addr(7), env_addr(3), env_addr(7)]
    assert p.annotations("rollout") == {"workers": [gpu_addr(2)], "allow_other_workers": False,
                                        "resources": {"GPU": 1}}
    assert {label: a["resources"] for label, a in p.node_annotations()} == {
        **{f"env_s{s}": {"CPU": 1} for s in range(4)}, "actor_r0": {"GPU": 1}, "actor_r1": {"GPU": 1},
        "rollout_g0": {"GPU": 1}}


def test_plan_hybrid_and_worker_order():
    # gpu-10 is device 10, not device 2 (natural order of names)
    p = plan_placement(config({"actor": "0-11", "env": "0-1", "rollout": "10"}, num_env_workers=2), info(2, 12))
    assert p.mode == "hybrid"
    assert p.rollout_worker == gpu_addr(10) and p.actor_workers == [gpu_addr(i) for i in range(12)]


def test_plan_multi_host_env_workers_serve_their_hosts_gpus():
    a = info(2, 1, host="10.0.0.1")["workers"]
    b = info(2, 1, host="10.0.0.2", start=50000)["workers"]
    # names must be unique in a real cluster: host b's workers are env-2, env-3, gpu-1
    b = {addr: {**w, "name": {"env-0": "env-2", "env-1": "env-3", "gpu-0": "gpu-1"}[w["name"]]} for addr, w in b.items()}
    cluster = {"workers": {**a, **b}}
    p = plan_placement(config({"actor": "0", "rollout": "1", "env": "1"}, num_gpus=2), cluster)
    assert p.mode == "hybrid"  # rollout and env share device 1
    assert p.shard_workers == [env_addr(0, "10.0.0.2", 50000), env_addr(1, "10.0.0.2", 50000)]
    assert p.actor_worker == gpu_addr(0, "10.0.0.1") and p.rollout_worker == gpu_addr(0, "10.0.0.2", 50000)


def test_num_gpus_uses_the_first_gpu_workers():
    p = plan_placement(config({"actor,rollout": "all"}, num_gpus=2), info(2, 4))
    assert p.gpu_workers == [gpu_addr(0), gpu_addr(1)] and p.actor_workers == p.gpu_workers


def test_graphs_built_on_a_planned_placement_pass_the_resource_check():
    cluster = info(2, 1)
    cfg = config()
    p = plan_placement(cfg, cluster)
    for inference in ("colocated", "disaggregated"):
        cfg = replace_key(cfg, "rollout.inference", inference)
        sg = graphs.build_train_step(cfg, run_id="r", step=0, weights={"version": 0}, cursors=[None, None],
                                     placement=p, store_path=None, dims=(3, 2))
        check_graph(sg.graph, cluster)
    # the same graph on a cluster whose GPU worker came back without its resource
    lost_gpu = {"workers": {**cluster["workers"], gpu_addr(0): {"name": "gpu-0", "resources": {"CPU": 1}}}}
    with pytest.raises(PlacementError, match=r"node policy_infer-r-0-0 needs resource GPU=1, none of the 3 workers "
                                             r"has it \(CPU=1 on 3 workers\)"):
        check_graph(sg.graph, lost_gpu)


# ----- the embedded cluster's GPU workers -----

def test_embedded_cluster_starts_one_gpu_worker_per_cuda_device():
    assert gpu_worker_specs(config(), 4) == [("gpu-0", 0), ("gpu-1", 1), ("gpu-2", 2), ("gpu-3", 3)]
    assert gpu_worker_specs(config(num_gpus=2), 4) == [("gpu-0", 0), ("gpu-1", 1)]
    assert gpu_worker_specs(config(num_gpu_workers=2), 0) == [("gpu-0", None), ("gpu-1", None)]  # logical
    assert gpu_worker_specs(config(num_gpus=3), 0) == [("gpu-0", None), ("gpu-1", None), ("gpu-2", None)]
    with pytest.raises(PlacementError, match=r"^cluster\.num_gpus=8: this machine has 4 CUDA devices"):
        gpu_worker_specs(config(num_gpus=8), 4)
    assert _worker_env(3)["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in _worker_env(None)


# ----- the multi-rank actor (algorithm.num_actor_ranks > 1) -----

def _ranks_config(placement: dict | None = None, ranks: int = 2, **cluster) -> Config:
    cfg = replace_key(config(placement, **cluster), "algorithm.num_actor_ranks", ranks)
    return check_config(cfg)


def test_more_actor_ranks_than_gpu_workers_is_rejected_offline_with_the_numbers():
    """`algorithm.num_actor_ranks=2` with 1 GPU worker: rejected by `pipelines.validate` and before the embedded
    cluster starts a worker (gpu_worker_specs), and by plan_placement on a live cluster."""
    from pipelines.config import load_config
    cfg, _ = load_config(["conf=smoke", "algorithm.num_actor_ranks=2"], components=False)
    with pytest.raises(PlacementError) as err:
        check_placement(cfg, cuda_count=0)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("algorithm.num_actor_ranks=2: needs 2 actor devices (one GPU worker "
                                              "per rank), cluster.component_placement.actor=0 (default) gives 1 of "
                                              "the 1 GPU (cluster.num_gpu_workers=1, no CUDA device)"), msg
    with pytest.raises(PlacementError, match="algorithm.num_actor_ranks=2: needs 2 actor devices"):
        gpu_worker_specs(cfg, 0)
    # two GPU workers but the actor left on device 0: the fix names the placement
    with pytest.raises(PlacementError, match=r"gives 1 of the 2 GPUs .*cluster.component_placement.actor=0-1\)"):
        check_placement(_ranks_config(num_gpu_workers=2), cuda_count=0)
    with pytest.raises(PlacementError, match=r"gives 1 of the 2 GPUs \(2 GPU workers in the cluster\)"):
        plan_placement(_ranks_config(), info(2, 2))
    ok = _ranks_config({"actor": "0-1"}, num_gpu_workers=2)
    assert check_placement(ok, cuda_count=0).devices["actor"] == (0, 1)
    assert plan_placement(ok, info(2, 2)).actor_workers == [gpu_addr(0), gpu_addr(1)]


def test_multi_rank_graphs_pin_one_rank_per_actor_worker():
    from tasks.actor.distributed import group_specs
    cluster = info(2, 2)
    cfg = _ranks_config({"actor": "0-1"}, num_gpu_workers=2)
    p = plan_placement(cfg, cluster)
    specs = group_specs(2, "127.0.0.1", 29500, 0)
    sg = graphs.build_train_step(cfg, run_id="r", step=3, weights={"version": 0}, cursors=[None, None],
                                 placement=p, store_path=None, group=specs, actor_weights={"version": 0})
    check_graph(sg.graph, cluster)
    assert sg.ranks == ["actor_update_r0-r-3", "actor_update_r1-r-3"] and sg.update == sg.ranks[0]
    for r, key in enumerate(sg.ranks):
        assert sg.graph.layers[key].annotations == {"workers": [gpu_addr(r)], "allow_other_workers": False,
                                                    "resources": {"GPU": 1}}
        assert sg.graph.layers[key][key][3] == specs[r]  # (fn, cfg, run_id, group, weights, *advantages)
    # a failed rank fails the step: rank 0 through the handle of its weights (tasks.weights), the others directly
    assert sg.graph.dependencies[sg.metrics] >= {"update_handle-r-3", *sg.ranks[1:]}
    assert sg.graph.dependencies["update_handle-r-3"] == {sg.ranks[0]}
    assert sg.graph.layers["update_handle-r-3"].annotations["workers"] == [gpu_addr(0)]
    assert "actor_update-r-3" not in sg.graph.layers
    graph, key = graphs.build_checkpoint(run_id="r", step=3, run_dir="/tmp/x", meta={}, placement=p, cfg=cfg,
                                         group=specs, weights={"version": 3}, dims=(3, 2))
    check_graph(graph, cluster)
    states = [k for k in graph.layers if k.startswith("actor_state_r")]
    assert sorted(states) == ["actor_state_r0-r-3", "actor_state_r1-r-3"]
    assert set(states) <= graph.dependencies["checkpoint-r-3"]
    init = graphs.build_init(cfg, run_id="r", placement=p, checkpoint_path=None)
    assert init.port == "free_port-r" and init.graph.layers[init.port].annotations["workers"] == [gpu_addr(0)]
    assert init.actor_weights != init.weights
    with pytest.raises(ValueError, match="needs 2 group specs"):
        graphs.build_train_step(cfg, run_id="r", step=3, weights={"version": 0}, cursors=[None, None],
                                placement=p, store_path=None)


# ----- cluster.component_placement.rollout takes effect (disaggregated) or is refused -----

def _infer_workers(sg) -> dict[str, str]:
    """policy_infer node key -> the worker it is pinned to."""
    return {name: layer.annotations["workers"][0] for name, layer in sg.graph.layers.items()
            if name.startswith("policy_infer")}


@pytest.mark.parametrize("spec, p, expect", [
    ({"actor": "0", "rollout": "1"}, 1, {"": 1}),  # the one inference chain on the rollout's device
    ({"actor": "0", "rollout": "1-2"}, 2, {"_p0": 1, "_p1": 2}),  # stage j on rollout device j mod 2
    ({"actor": "0", "rollout": "2"}, 2, {"_p0": 2, "_p1": 2}),
    ({}, 1, {"": 0}),  # default: with the actor
])
def test_disaggregated_policy_infer_runs_on_the_placed_rollout_workers(spec, p, expect):
    cfg = replace_keys(config(spec, num_gpu_workers=3), {"rollout.inference": "disaggregated",
                                                         "rollout.pipeline_stage_num": p})
    cluster = info(2, 3)
    check_placement(cfg, cuda_count=0)  # offline: accepted
    pl = plan_placement(cfg, cluster)
    sg = graphs.build_train_step(cfg, run_id="r", step=0, weights={"version": 0}, cursors=[None, None],
                                 placement=pl, store_path=None, dims=(3, 2))
    pinned = _infer_workers(sg)
    T = cfg.rollout.chunk_steps
    assert len(pinned) == p * (T + 1)
    for name, worker in pinned.items():
        stage = name.split("-")[0][len("policy_infer"):]
        assert worker == gpu_addr(expect[stage]), name
    check_graph(sg.graph, cluster)


@pytest.mark.parametrize("spec, setup, key, words", [
    ({"rollout": "0"}, {}, "cluster.component_placement.rollout", "rollout.inference=disaggregated"),
    ({"actor,rollout": "0"}, {}, "cluster.component_placement.actor,rollout", "place rollout with env"),
    ({"rollout": "1-2"}, {"inference": "disaggregated"}, "cluster.component_placement.rollout",
     "rollout.pipeline_stage_num=1"),
    ({"actor": "0-1"}, {}, "cluster.component_placement.actor", "algorithm.num_actor_ranks=1 uses 1"),
])
def test_placement_entries_that_do_nothing_are_refused_offline(spec, setup, key, words):
    cfg = replace_keys(config(spec, num_gpu_workers=3), {f"rollout.{k}": v for k, v in setup.items()})
    with pytest.raises(PlacementError) as err:
        check_placement(cfg, cuda_count=0)
    assert err.value.key == key and words in err.value.fix, str(err.value)


@pytest.mark.parametrize("spec", [{"actor,env,rollout": "all"}, {"env,rollout": "0-2", "actor": "0"},
                                  {"env": "1", "rollout": "1"}])
def test_colocated_rollout_placed_with_env_is_accepted(spec):
    cfg = config(spec, num_gpu_workers=3 if "actor,env,rollout" not in spec else 1)
    assert check_placement(cfg, cuda_count=0) is not None


def test_actor_worker_threads_and_wait_policy(monkeypatch):
    """The actor (GPU-resource) worker gets cluster.actor_threads torch threads, else the cores the env workers
    leave (at least 1); its idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE); env workers stay at 1 thread."""
    from pipelines.clusters.local import cluster_specs
    cfg = Config()
    for cores, want in ((2, 1), (8, 6), (1, 1)):
        monkeypatch.setattr(os, "cpu_count", lambda c=cores: c)
        _, workers = cluster_specs(cfg, [("gpu-0", None)])
        env = workers["gpu-0"]["options"]["env"]
        assert (env["OMP_NUM_THREADS"], env["OMP_WAIT_POLICY"]) == (str(want), "PASSIVE"), cores
        assert {workers[f"env-{i}"]["options"]["env"]["OMP_NUM_THREADS"] for i in range(2)} == {"1"}
    cfg = replace_key(cfg, "cluster.actor_threads", 2)
    _, workers = cluster_specs(cfg, [("gpu-0", None), ("gpu-1", None)])
    assert {workers[g]["options"]["env"]["OMP_NUM_THREADS"] for g in ("gpu-0", "gpu-1")} == {"2"}
    cfg = replace_key(cfg, "cluster.actor_threads", 0)
    with pytest.raises(ConfigError, match="cluster.actor_threads"):
        check_local(cfg)


@pytest.mark.cluster
def test_embedded_cluster_workers_keep_glibc_malloc_defaults(monkeypatch):
    """Dask's Nanny spawns workers with MALLOC_TRIM_THRESHOLD_=65536 (and leaves it in the driver's os.environ);
    that switches off glibc's dynamic mmap threshold, and the actor's update then faulted ~130k pages per update
    (benchmarks/update_gap.py --dask). The embedded cluster spawns every worker without it, also after a Nanny of
    another cluster left it in os.environ; a value the user exported before dagrl started is kept."""
    import pipelines.clusters as pc
    import pipelines.clusters.local as local
    from pipelines.config import load_config
    cfg, _ = load_config(["conf=smoke", "cluster.num_env_workers=1"])
    monkeypatch.setattr(local, "_USER_MALLOC_TRIM", None)
    monkeypatch.setenv(local.MALLOC_TRIM, "65536")  # what an earlier Nanny in this process leaves behind
    handle = pc.start_cluster(cfg)
    try:
        seen = handle.client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_"))
        assert len(seen) == 2 and set(seen.values()) == {None}, seen
    finally:
        handle.close()
    assert local.MALLOC_TRIM not in os.environ
    monkeypatch.setattr(local, "_USER_MALLOC_TRIM", "1048576")  # the user's own setting: left to them
    monkeypatch.setenv(local.MALLOC_TRIM, "1048576")
    local.glibc_malloc_defaults()
    assert os.environ[local.MALLOC_TRIM] == "1048576"
