"""Graph builders: building is lazy, keys are readable and unique, placement annotations; and one training step's
graph executed for real with dask's synchronous scheduler (no cluster) on a fake simulator."""
from __future__ import annotations

import math

import dask
import numpy as np
import pytest
from dask.highlevelgraph import HighLevelGraph
from dask.utils import key_split

import tasks.envs
from pipelines import graphs
from pipelines.clusters import Placement
from pipelines.runner import trajectory_fields
from storage.trajectories import TrajectoryStore
from tasks import resident, rollout
from tasks.actor import entries
from tasks.config import Config, replace_key, replace_keys
from tasks.config import check_config

RUN_A, RUN_B = "20260101-120000-a1b2", "20260101-120000-c3d4"
PLACEMENT = Placement(shard_workers=["tcp://10.0.0.1:4001", "tcp://10.0.0.2:4002"],
                      actor_worker="tcp://10.0.0.3:4003")


@pytest.fixture(autouse=True)
def clean_resident():
    resident.release("")
    yield
    resident.release("")


def small_config(**rollout_kw) -> Config:
    cfg = replace_keys(Config(), {"env.num_envs": 4, "env.num_shards": 2, "rollout.chunk_steps": 6,
                                  "rollout.chunk_steps_per_node": 2,
                                  **{f"rollout.{k}": v for k, v in rollout_kw.items()},
                                  "policy.hidden_sizes": [16, 16], "algorithm.num_minibatches": 2,
                                  "algorithm.update_epochs": 2})
    return check_config(cfg)


def build(cfg, run_id=RUN_A, step=0, store_path="/nonexistent/trajectories.zarr"):
    weights = {"version": 0, "state_dict": {}}
    return graphs.build_train_step(cfg, run_id=run_id, step=step, weights=weights, cursors=[None, None],
                                   placement=PLACEMENT, store_path=store_path)


def test_building_a_step_graph_computes_nothing(monkeypatch):
    calls = []

    def record(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} ran while the graph was only being built")
        return fn

    for mod, name in ((rollout, "env_step"), (rollout, "trajectory"), (entries, "advantages"),
                      (entries, "actor_update"), (graphs, "step_metrics"), (graphs, "_store")):
        monkeypatch.setattr(mod, name, record(name))
    sg = build(small_config())
    assert isinstance(sg.graph, HighLevelGraph)
    assert calls == []
    assert resident.keys() == []
    # the graph does hold the recorded functions: they would run on execution, not before
    tasks = dict(sg.graph)
    env_step_fns = {tasks[k][0].__qualname__ for k in tasks if key_split(k).startswith("env_step")}
    assert env_step_fns == {"test_building_a_step_graph_computes_nothing.<locals>.record.<locals>.fn"}


def test_keys_are_readable_and_unique():
    cfg = small_config()
    steps = [build(cfg, RUN_A, 0), build(cfg, RUN_A, 1), build(cfg, RUN_B, 0)]
    keysets = [set(dict(sg.graph)) for sg in steps]
    assert all(len(ks) == len(dict(steps[0].graph)) for ks in keysets)
    assert keysets[0].isdisjoint(keysets[1]) and keysets[0].isdisjoint(keysets[2])
    assert keysets[1].isdisjoint(keysets[2])
    prefixes = {key_split(k) for k in keysets[0]}
    assert prefixes == {"env_step_s0", "env_step_s1", "trajectory_s0", "trajectory_s1", "store_s0", "store_s1",
                        "advantages_s0", "advantages_s1", "actor_update", "update_handle", "step_metrics"}
    assert steps[0].update == f"actor_update-{RUN_A}-0" and steps[0].metrics == f"step_metrics-{RUN_A}-0"
    assert sorted(steps[0].stores) == [f"store_s0-{RUN_A}-0", f"store_s1-{RUN_A}-0"]
    # without a store path there are no store nodes
    no_store = build(cfg, store_path=None)
    assert no_store.stores == [] and not any(key_split(k).startswith("store") for k in dict(no_store.graph))
    # the store writes submitted apart (the scheduler, after the reserve) are the same nodes on the same inputs
    apart, keys = graphs.build_step_store(run_id=RUN_A, step=0, attempt=0, store_path="/nonexistent/trajectories.zarr",
                                          trajs=no_store.trajs, store_attempt=None)
    assert keys == steps[0].stores and dict(apart) == {k: dict(steps[0].graph)[k] for k in keys}
    assert no_store.trajs == [f"trajectory_s0-{RUN_A}-0", f"trajectory_s1-{RUN_A}-0"]
    retry, keys = graphs.build_step_store(run_id=RUN_A, step=4, attempt=2, store_path="/p", trajs=["a", "b"],
                                          store_attempt=3)
    assert keys == [f"store_s0-{RUN_A}-4-retry2", f"store_s1-{RUN_A}-4-retry2"]
    assert [dict(retry)[k][1:] for k in keys] == [("/p", 4, 0, "a", 3), ("/p", 4, 1, "b", 3)]


@pytest.mark.parametrize("chunk_steps, per_node", [(6, 2), (6, 6), (6, 1)])
def test_env_step_nodes_per_shard(chunk_steps, per_node):
    cfg = small_config(chunk_steps=chunk_steps, chunk_steps_per_node=per_node)
    sg = build(cfg)
    env_keys = [k for k in dict(sg.graph) if key_split(k).startswith("env_step")]
    assert len(env_keys) == cfg.env.num_shards * chunk_steps // per_node
    # segments of one shard are chained in order: segment k depends on segment k-1
    for s in range(cfg.env.num_shards):
        for k in range(1, chunk_steps // per_node):
            assert sg.graph.dependencies[f"env_step_s{s}-{RUN_A}-0-{k}"] == {f"env_step_s{s}-{RUN_A}-0-{k - 1}"}
        assert sg.graph.dependencies[f"env_step_s{s}-{RUN_A}-0-0"] == set()


def test_placement_annotations():
    sg = build(small_config())
    layers = sg.graph.layers
    for key, layer in layers.items():
        ann = layer.annotations or {}
        kind = key_split(key)
        if kind.startswith("env_step_s"):
            s = int(kind[len("env_step_s"):])
            assert ann == {"workers": [PLACEMENT.shard_workers[s]], "allow_other_workers": False,
                           "resources": {"CPU": 1}}
        elif kind == "actor_update":
            assert ann == {"workers": [PLACEMENT.actor_worker], "allow_other_workers": False,
                           "resources": {"GPU": 1}}
        elif kind == "update_handle":  # where the new weights are: nothing but the handle leaves that worker
            assert ann == {"workers": [PLACEMENT.actor_worker], "allow_other_workers": False}
        elif kind.startswith("advantages_s"):  # anywhere, ahead of the store on its worker (the update waits)
            assert ann == {"priority": graphs.STEP_PRIORITY} and graphs.STEP_PRIORITY > 0, (key, ann)
        else:  # stateless nodes: anywhere
            assert ann == {}, (key, ann)
    assert sg.graph.dependencies[sg.update] == {f"advantages_s0-{RUN_A}-0", f"advantages_s1-{RUN_A}-0"}
    handle = f"update_handle-{RUN_A}-0"
    assert sg.graph.dependencies[handle] == {sg.update}
    assert sg.graph.dependencies[sg.metrics] == {handle, *(f"{p}_s{s}-{RUN_A}-0" for p in ("trajectory", "advantages")
                                                           for s in (0, 1))}
    assert sg.handle == handle
    # the advantages take the shard's env_step segments directly (not its trajectory node)
    for s in (0, 1):
        segs = {k for k in sg.graph.layers if key_split(k) == f"env_step_s{s}"}
        assert len(segs) > 1 and sg.graph.dependencies[f"advantages_s{s}-{RUN_A}-0"] == segs


def test_a_given_weights_handle_replaces_the_weights_handle_node():
    """The scheduler passes the previous step's update_handle (a Future) as `weights_handle`: the rollout nodes
    take it and the graph has no weights_handle node; without it, the node makes the handle from a weights key."""
    cfg = small_config()
    made = graphs.build_train_step(cfg, run_id=RUN_A, step=1, weights="actor_update-x-0", cursors=[None, None],
                                   placement=PLACEMENT, store_path=None)
    tasks = dict(made.graph)
    assert f"weights_handle-{RUN_A}-1" in tasks
    assert tasks[f"env_step_s0-{RUN_A}-1-0"][4] == f"weights_handle-{RUN_A}-1"
    given = graphs.build_train_step(cfg, run_id=RUN_A, step=1, weights="actor_update-x-0", cursors=[None, None],
                                    placement=PLACEMENT, store_path=None, weights_handle="update_handle-x-0")
    tasks = dict(given.graph)
    assert not any(key_split(k) == "weights_handle" for k in tasks)
    assert {tasks[k][4] for k in tasks if key_split(k).startswith("env_step")} == {"update_handle-x-0"}
    # the update still starts from the weights themselves
    assert "actor_update-x-0" in tasks[given.update][1:]


# ----- the step graph executed for real, synchronously, on a fake simulator -----------------------------------
class FakeEnv:
    """Deterministic: obs = [t/10, seed/100, 1], reward = mean of the action, truncated after 4 steps."""

    obs_dim, action_dim = 3, 2

    def __init__(self, cfg=None):
        self.t, self.seed = 0, 0

    def _obs(self):
        return np.array([self.t / 10, self.seed / 100, 1.0], np.float32)

    def reset(self, seed):
        self.t, self.seed = 0, seed
        return self._obs()

    def step(self, action):
        self.t += 1
        return self._obs(), float(action.mean()), False, self.t >= 4, False

    def close(self):
        pass


def test_step_graph_runs_with_the_synchronous_scheduler(monkeypatch, tmp_path):
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    cfg = small_config()
    store = TrajectoryStore.create(tmp_path / "trajectories.zarr", fields=trajectory_fields(cfg, 3, 2),
                                   T=cfg.rollout.chunk_steps, num_envs=cfg.env.num_envs,
                                   shard_size=cfg.env.shard_size)
    store.reserve(0)
    weights = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    assert weights["version"] == 0
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=weights, cursors=[None, None],
                                 placement=PLACEMENT, store_path=str(store.path))
    upd, met, *written = dask.get(sg.graph, [sg.update, sg.metrics, *sg.stores])

    assert upd["version"] == 1
    m = upd["metrics"]
    for k in ("train/actor_loss", "train/critic_loss", "train/entropy", "train/approx_kl", "train/grad_norm"):
        assert math.isfinite(m[k]), (k, m[k])
    assert m["train/weight_version"] == 1.0 and m["train/actor_rebuilt"] == 0.0
    assert 1 <= m["train/minibatch_updates"] <= cfg.algorithm.update_epochs * cfg.algorithm.num_minibatches
    assert set(upd["state_dict"]) == set(weights["state_dict"])
    assert any(not np.array_equal(upd["state_dict"][k], weights["state_dict"][k]) for k in weights["state_dict"])

    # 6 chunk steps of episodes truncated after 4: one finished episode per env, returns = sum of action means
    metrics = met["metrics"]
    assert metrics["env/num_episodes"] == 4.0 and metrics["env/episode_len"] == 4.0
    assert metrics["train/weight_version"] == 1.0 and "rollout/advantage_mean" in metrics
    assert [c["episode_count"] for c in met["cursors"]] == [[1, 1], [1, 1]]  # + the open episodes (EnvShard)
    assert sorted(e["seed"] for e in met["episodes"]) == [0, 1, 2, 3]  # seed rule: 0 + g + k*4, k=0

    # the stored trajectories: obs are the fake observations, seeds follow the rule
    assert all(w["bytes"] > 0 for w in written)
    obs = store.read("obs")  # [E, T, B, O]
    assert obs.shape == (1, 6, 4, 3)
    np.testing.assert_allclose(obs[0, :, 0, 0], [0, .1, .2, .3, 0, .1], rtol=1e-6)  # t/10, reset after 4 steps
    seeds = store.read("episode_seed")[0]
    np.testing.assert_array_equal(seeds[:4], [[0, 1, 2, 3]] * 4)
    np.testing.assert_array_equal(seeds[4:], [[4, 5, 6, 7]] * 2)
    trunc = store.read("truncated")[0]
    np.testing.assert_array_equal(trunc.sum(0), [1, 1, 1, 1])
    assert trunc[3].all()
    fv = store.read("final_values")[0]
    assert (fv[3] != 0).all() and (np.delete(fv, 3, axis=0) == 0).all()  # V(final_obs) only where truncated
    # the resident state the nodes created on this (single) process
    assert resident.keys() == sorted([f"{RUN_A}/actor", f"{RUN_A}/policy", f"{RUN_A}/shard/0", f"{RUN_A}/shard/1"])
    assert resident.get(f"{RUN_A}/policy").version == 0


def test_init_and_eval_graphs_run_with_the_synchronous_scheduler(monkeypatch):
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    cfg = replace_keys(small_config(), {"env.eval.num_envs": 2, "env.eval.num_episodes": 3})
    init = graphs.build_init(cfg, run_id=RUN_B, placement=PLACEMENT, checkpoint_path=None)
    graph, dims_key, w_key = init.graph, init.dims, init.weights
    assert resident.keys() == []
    dims, weights = dask.get(graph, [dims_key, w_key])
    assert dims == (3, 2) and weights["version"] == 0
    graph, keys = graphs.build_eval(cfg, run_id=RUN_B, step=0, weights=weights, placement=PLACEMENT)
    episodes = [e for part in dask.get(graph, keys) for e in part]
    # eval episode i runs with seed eval.seed + i, all of them to the 4-step limit
    assert sorted(e["seed"] for e in episodes) == [cfg.env.eval.seed + i for i in range(3)]
    assert [e["episode_len"] for e in episodes] == [4, 4, 4]


class RenderFakeEnv(FakeEnv):
    """FakeEnv that renders: frame = a uniform image of brightness 40 * t (t: actions since the reset)."""

    fps = 10.0

    def __init__(self, cfg=None, render_size=None):
        super().__init__(cfg)
        self.size = render_size or 64

    def render_frame(self):
        return np.full((self.size, self.size, 3), min(255, 40 * self.t), np.uint8)


def test_eval_graph_films_the_first_episodes(monkeypatch, tmp_path):
    """With video_dir: the shards' eval nodes keep the executed actions of episodes 0..k-1 (k = runner.eval_videos)
    and one eval_videos node after them replays exactly those on a rendering instance: one mp4 per episode with
    episode_len + 1 frames, the replay's return equal to the eval's (same seed, same actions)."""
    import imageio.v2 as imageio
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg, render_size=None: RenderFakeEnv(cfg, render_size))
    cfg = replace_keys(small_config(), {"env.eval.num_envs": 2, "env.eval.num_episodes": 3, "runner.eval_videos": 2,
                                        "runner.eval_video_size": 64})
    weights = entries.actor_init(cfg, RUN_B, (FakeEnv.obs_dim, FakeEnv.action_dim))
    (tmp_path / "videos").mkdir()  # the driver makes it (the runner, pipelines.eval); the node never does
    graph, keys = graphs.build_eval(cfg, run_id=RUN_B, step=7, weights=weights, placement=PLACEMENT,
                                    video_dir=str(tmp_path / "videos"))
    assert len(keys) == cfg.env.num_shards + 1 and keys[-1] == f"eval_videos-{RUN_B}-7"
    assert graph.dependencies[keys[-1]] == set(keys[:-1])
    *parts, vids = dask.get(graph, keys)
    episodes = {e["episode_id"]: e for part in parts for e in part}
    assert sorted(episodes) == [0, 1, 2]
    assert "actions" not in episodes[2]  # only the filmed ones carry their actions
    for i in (0, 1):
        a = episodes[i]["actions"]
        assert a.shape == (4, FakeEnv.action_dim) and a.dtype == np.float32
        assert float(a.mean(axis=1).sum()) == pytest.approx(episodes[i]["return"], abs=1e-5)  # reward = mean(a)
    assert vids["error"] is None and [v["episode_id"] for v in vids["videos"]] == [0, 1]
    for v in vids["videos"]:
        assert v["return_matches"] and v["return"] == pytest.approx(episodes[v["episode_id"]]["return"])
        frames = np.stack(imageio.mimread(v["path"], memtest=False))
        assert frames.shape == (5, 64, 64, 3) and v["frames"] == 5 and v["fps"] == 10.0
        scene = frames[:, 30:].reshape(5, -1).mean(axis=1)  # below the caption bar: brightness 40 * t
        np.testing.assert_allclose(scene, [0, 40, 80, 120, 160], atol=6)
    # without video_dir (or with runner.eval_videos=0) the graph has no video node and no episode keeps actions
    graph, keys = graphs.build_eval(cfg, run_id=RUN_B, step=8, weights=weights, placement=PLACEMENT)
    assert len(keys) == cfg.env.num_shards
    assert not any("actions" in e for part in dask.get(graph, keys) for e in part)


def _rollout_with(monkeypatch, inference: str) -> tuple[dict, list[str], dict]:
    """Run one step with the given inference mode; return shard 0's trajectory, the key prefixes, the update."""
    import torch
    resident.release("")
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    cfg = small_config(inference=inference)
    weights = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=weights, cursors=[None, None],
                                 placement=PLACEMENT, store_path=None, dims=(3, 2))
    torch.manual_seed(123)  # shards seed their own noise on creation; this fixes everything after
    traj = dask.get(sg.graph, f"trajectory_s0-{RUN_A}-0")
    upd = dask.get(sg.graph, sg.update)
    return traj, sorted({key_split(k) for k in sg.graph.layers}), upd


def test_disaggregated_rollout_matches_colocated(monkeypatch):
    col, col_prefixes, _ = _rollout_with(monkeypatch, "colocated")
    dis, dis_prefixes, upd = _rollout_with(monkeypatch, "disaggregated")
    assert "policy_infer" in dis_prefixes and "env_observe_s0" in dis_prefixes
    assert "policy_infer" not in col_prefixes
    # same env dynamics and bookkeeping in both modes; the fake env's obs/rewards do not depend on the noise
    # except through rewards, so compare the action-independent fields exactly and shapes of the rest
    for k in ("obs", "terminated", "truncated", "step_mask", "episode_seed", "episode_id"):
        np.testing.assert_array_equal(col[k], dis[k], err_msg=k)
    for k in rollout.STEP_FIELDS:
        assert col[k].shape == dis[k].shape, k
    # behaviour log-probs belong to the stored actions under the rollout weights in both modes
    pol = resident.get(f"{RUN_A}/policy").module
    import torch
    T, B = dis["obs"].shape[:2]
    lp = pol.evaluate({"state": torch.from_numpy(dis["obs"].reshape(T * B, -1))},
                      torch.from_numpy(dis["actions"].reshape(T * B, *dis["actions"].shape[2:])))["logprobs"]
    np.testing.assert_allclose(lp.detach().numpy().reshape(dis["logprobs"].shape), dis["logprobs"], rtol=1e-5,
                               atol=1e-5)
    assert (dis["final_values"][3] != 0).all() and (np.delete(dis["final_values"], 3, axis=0) == 0).all()
    assert upd["version"] == 1


def test_action_level_rewards_train_through_the_step_graph(monkeypatch):
    """reward_type=action_level with C=2: per-action GAE ([T, B, C] advantages) and an update with finite losses."""
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    cfg = replace_keys(small_config(), {"policy.num_action_chunks": 2, "algorithm.reward_type": "action_level",
                                        "algorithm.logprob_type": "action_level"})
    check_config(cfg)
    weights = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=weights, cursors=[None, None],
                                 placement=PLACEMENT, store_path=None)
    adv, upd = dask.get(sg.graph, [f"advantages_s0-{RUN_A}-0", sg.update])
    assert adv["advantages"].shape == (6, 2, 2) and adv["values"].shape == (6, 2, 2)
    assert upd["version"] == 1 and math.isfinite(upd["metrics"]["train/critic_loss"])


# ----- weight sync and offload metrics of a step (tasks.weights, tasks.offload) --------------------------------
def test_step_metrics_report_the_weight_sync_of_the_replica(monkeypatch):
    """One process holds one replica: the first shard's node loads version 0 (the state dict's bytes), the
    second shard's finds it loaded (0 bytes); a second step with the same weights loads nothing."""
    from tasks.weights import state_dict_nbytes
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    cfg = small_config()
    weights = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    nbytes = state_dict_nbytes(weights["state_dict"])
    # hidden [16, 16] MLP on obs 3 / action 2: actor + critic Linear layers and the log-std, float32
    n_params = (3 * 16 + 16 + 16 * 16 + 16 + 16 * 2 + 2) + (3 * 16 + 16 + 16 * 16 + 16 + 16 * 1 + 1) + 2
    assert nbytes == 4 * n_params
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=weights, cursors=[None, None],
                                 placement=PLACEMENT, store_path=None)
    met = dask.get(sg.graph, sg.metrics)["metrics"]
    assert met["system/weight_sync_mb"] == pytest.approx(nbytes / 1e6)
    assert 0.0 < met["time/weight_sync"] < 5.0
    assert "time/offload_replica_max" in met and met["time/offload_replica_max"] == 0.0  # offload off: no moves
    again = graphs.build_train_step(cfg, run_id=RUN_A, step=1, weights=weights, cursors=[None, None],
                                    placement=PLACEMENT, store_path=None)
    met2 = dask.get(again.graph, again.metrics)["metrics"]
    assert met2["system/weight_sync_mb"] == 0.0 and met2["time/weight_sync"] == 0.0


def test_offload_step_logs_the_actor_memory_around_the_move(monkeypatch):
    """algorithm.offload on a CPU-only machine: the update node is the offload wrapper (same key), the moves are
    cpu -> cpu no-ops, and the metrics say so: the actor's bytes on its device are the parameters plus Adam's two
    moments (and the gradients), before and after alike."""
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    cfg = replace_key(small_config(), "algorithm.offload", True)
    check_config(cfg)
    weights = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=weights, cursors=[None, None],
                                 placement=PLACEMENT, store_path=None)
    assert dict(sg.graph)[sg.update][0] is entries.actor_update_offload
    upd, met = dask.get(sg.graph, [sg.update, sg.metrics])
    m = upd["metrics"]
    actor = resident.get(f"{RUN_A}/actor")
    params = sum(p.numel() * 4 for p in actor.policy.parameters())
    grads = sum(p.grad.numel() * 4 for p in actor.policy.parameters() if p.grad is not None)
    adam = 2 * params  # exp_avg, exp_avg_sq
    steps = sum(s["step"].numel() * s["step"].element_size() for s in actor.optimizer.state.values())
    assert m["system/actor_device_mb_before_offload"] == pytest.approx((params + grads + adam + steps) / 1e6)
    assert m["system/actor_device_mb_after_offload"] == m["system/actor_device_mb_before_offload"]  # cpu: no-op
    assert 0.0 <= m["time/offload"] < 1.0
    assert met["metrics"]["time/offload"] == m["time/offload"]
    assert met["metrics"]["time/offload_replica_max"] >= 0.0


def test_step_metrics_per_task_when_episodes_span_several_tasks():
    """env/task_<id>/* from the finished episodes' task_id (hand-computed means); none for one task."""
    from tasks import trajectory

    def ep(task, succ, ret):
        return {"task_id": task, "success_once": succ, "success_at_end": succ, "return": ret, "episode_len": 3}
    traj = {trajectory.Meta.EPISODES: [ep(0, True, 1.0), ep(0, False, 0.0), ep(3, True, 2.0)],
            trajectory.Meta.TIMING: {"env": 0.0, "infer": 0.0, "total": 0.0}, trajectory.Meta.CURSOR: {}}
    out = graphs.step_metrics({"metrics": {}, "version": 1}, traj, {"stats": {}})["metrics"]
    assert out["env/task_0/num_episodes"] == 2 and out["env/task_0/success_once"] == 0.5
    assert out["env/task_3/num_episodes"] == 1 and out["env/task_3/return"] == 2.0
    assert out["env/success_once"] == pytest.approx(2 / 3)
    one = {**traj, trajectory.Meta.EPISODES: [ep(0, True, 1.0)]}
    assert not [k for k in graphs.step_metrics({"metrics": {}, "version": 1}, one, {"stats": {}})["metrics"]
                if k.startswith("env/task_")]
