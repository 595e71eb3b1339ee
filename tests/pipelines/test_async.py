"""Asynchronous steps (runner.max_staleness) and pipeline stages (rollout.pipeline_stage_num).

Graph level, on the synchronous scheduler with the fake simulator of test_graphs: two consecutive step graphs
wired as the runner wires them with k = 1 (weight versions, cursors, proximal log-probs); p = 2 stage groups give
the bookkeeping of p = 1. End to end: `conf=smoke runner.max_staleness=1` on the real simulator.
"""
from __future__ import annotations

import dask
import numpy as np
import pytest
from dask.highlevelgraph import HighLevelGraph
from dask.utils import key_split

import tasks.envs
from pipelines import graphs
from tasks import resident
from tasks.actor import entries
from tasks.config import Config, ConfigError, replace_key, replace_keys
from tests.pipelines.test_graphs import PLACEMENT, RUN_A, FakeEnv, small_config
from tasks.config import check_config


@pytest.fixture(autouse=True)
def fake_env(monkeypatch):
    resident.release("")
    monkeypatch.setattr(tasks.envs, "make_single_env", lambda cfg: FakeEnv(cfg))
    yield
    resident.release("")


def _two_async_steps(cfg: Config):
    """Steps 0 and 1 as the runner submits them with max_staleness = 1: step 1's rollout on v(0) (the init
    weights), its update from step 0's output, its first env nodes after step 0's last ones."""
    w0 = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    kw = dict(run_id=RUN_A, cursors=[None, None], placement=PLACEMENT, store_path=None, dims=(3, 2))
    s0 = graphs.build_train_step(cfg, step=0, weights=w0, **kw)
    s1 = graphs.build_train_step(cfg, step=1, weights=w0, update_weights=s0.update, after=s0.last_env, **kw)
    merged = HighLevelGraph.merge(s0.graph, s1.graph)
    return s0, s1, merged


@pytest.mark.parametrize("inference", ["colocated", "disaggregated"])
def test_stale_step_uses_the_previous_weights_and_continues_the_shards(inference):
    cfg = small_config(inference=inference)
    s0, s1, merged = _two_async_steps(cfg)
    # step 1's first env nodes reference step 0's last ones: the shards' order across the two graphs
    first = [k for k in dict(s1.graph) if key_split(k).startswith(("env_observe", "env_step")) and
             (k.endswith("-1-0") or key_split(k).startswith("env_observe"))]
    tasks_ = dict(merged)
    for s, last in enumerate(s0.last_env):
        assert any(last in tasks_[k] for k in first if f"_s{s}" in k), (s, last)
    u0, m0, u1, m1 = dask.get(merged, [s0.update, s0.metrics, s1.update, s1.metrics])
    assert (u0["version"], u1["version"]) == (1, 2)
    mt0, mt1 = m0["metrics"], m1["metrics"]
    assert (mt0["train/behaviour_version"], mt0["train/staleness"]) == (0.0, 0.0)
    assert (mt1["train/behaviour_version"], mt1["train/staleness"]) == (0.0, 1.0)  # rollout 1 used v(0)
    # on-policy: proximal = behaviour; one version stale: proximal recomputed under v(1) differs
    assert mt0["train/proximal_logprob_mean"] == mt0["train/behaviour_logprob_mean"]
    assert mt1["train/proximal_logprob_mean"] != mt1["train/behaviour_logprob_mean"]
    # 6 chunk steps per rollout, episodes truncated after 4: 1 episode per env after step 0, 3 after step 1
    assert [c["episode_count"] for c in m0["cursors"]] == [[1, 1]] * 2
    assert [c["episode_count"] for c in m1["cursors"]] == [[3, 3]] * 2
    # step 1 continues the episodes step 0 left at t=2: its finished episodes are the 2nd and 3rd of each env
    assert sorted(e["seed"] for e in m1["episodes"]) == list(range(4, 12))
    assert all(e["episode_len"] == 4 for e in m1["episodes"])


def test_on_policy_update_is_unchanged_by_the_staleness_machinery():
    """Samples made with the actor's own version take plain PPO: the same update as without `weight_version`."""
    import torch
    cfg = small_config()
    w0 = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=w0, cursors=[None, None], placement=PLACEMENT,
                                 store_path=None)
    advs = dask.get(sg.graph, [f"advantages_s{s}-{RUN_A}-0" for s in range(2)])
    assert all(a["weight_version"] == 0 for a in advs)
    state = {k: v.clone() for k, v in resident.get(f"{RUN_A}/actor").policy.state_dict().items()}
    opt = resident.get(f"{RUN_A}/actor").optimizer.state_dict()
    outs = []
    for samples in (advs, [{k: v for k, v in a.items() if k != "weight_version"} for a in advs]):
        actor = resident.get(f"{RUN_A}/actor")
        actor.policy.load_state_dict(state)
        actor.optimizer.load_state_dict(opt)
        torch.manual_seed(5)
        outs.append(entries.actor_update(cfg, RUN_A, w0, *samples))
    for k in outs[0]["state_dict"]:
        assert torch.equal(outs[0]["state_dict"][k], outs[1]["state_dict"][k]), k


# ----- pipeline stages -----
def _disaggregated_step(p: int):
    cfg = small_config(inference="disaggregated", pipeline_stage_num=p)
    w0 = entries.actor_init(cfg, RUN_A, (FakeEnv.obs_dim, FakeEnv.action_dim))
    sg = graphs.build_train_step(cfg, run_id=RUN_A, step=0, weights=w0, cursors=[None, None], placement=PLACEMENT,
                                 store_path=None, dims=(3, 2))
    trajs = dask.get(sg.graph, [f"trajectory_s{s}-{RUN_A}-0" for s in range(2)])
    resident.release("")
    return sg, trajs


def test_two_pipeline_stages_keep_the_bookkeeping_of_one():
    sg1, one = _disaggregated_step(1)
    sg2, two = _disaggregated_step(2)
    T, S = 6, 2
    prefixes = {key_split(k) for k in sg2.graph.layers}
    assert {"policy_infer_p0", "policy_infer_p1", "env_step_s0p0", "env_step_s1p1", "env_observe_s0p1"} <= prefixes
    assert sum(key_split(k).startswith("policy_infer") for k in sg2.graph.layers) == 2 * (T + 1)
    assert sum(key_split(k).startswith("env_step") for k in sg2.graph.layers) == 2 * S * T
    # the two stage chains are independent: stage 1's inference never waits for stage 0's env steps
    deps = sg2.graph.dependencies
    for t in range(1, T + 1):
        assert all("p1" in key_split(d) for d in deps[f"policy_infer_p1-{RUN_A}-0-{t}"])
    assert len(sg2.last_env) == S * 2
    for a, b in zip(one, two):
        for k in ("obs", "terminated", "truncated", "step_mask", "episode_seed", "episode_id"):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        for k in ("actions", "logprobs", "values", "rewards", "final_values"):
            assert a[k].shape == b[k].shape, k
        assert a["bootstrap_values"].shape == b["bootstrap_values"].shape
        for f in ("episode_count", "seed", "active", "episode_len"):  # the bookkeeping (actions are draws)
            assert a["cursor"][f] == b["cursor"][f], f
        key = lambda e: (e["env"], e["episode_id"])  # noqa: E731
        assert sorted((e["env"], e["seed"], e["episode_id"], e["episode_len"]) for e in a["episodes"]) == \
            sorted((e["env"], e["seed"], e["episode_id"], e["episode_len"]) for e in b["episodes"])
        assert sorted(map(key, a["episodes"])) == sorted(map(key, b["episodes"]))
        assert b["weight_version"] == 0


def test_pipeline_stages_resume_from_a_shard_cursor():
    """A stage group re-created from the shard's cursor continues its envs' seed sequences."""
    cfg = small_config(inference="disaggregated", pipeline_stage_num=2)
    from pipelines.upgrade.checkpoints import full_cursor
    from tasks.rollout import get_shard
    cursor = full_cursor({"episode_count": [5, 7]})  # a shard's cursor at those counts, not started (no open episode)
    sh = get_shard(cfg, RUN_A, 1, cursor, stage=1)
    assert sh.num_envs == 1 and sh.env_offset == 3 and sh.episode_count.tolist() == [7]
    assert sh.seed_fn(3, 7) == 3 + 7 * 4


@pytest.mark.parametrize("overrides, key, words", [
    (dict(pipeline_stage_num=3), "rollout.pipeline_stage_num", "must divide the env shard size 2"),
    (dict(pipeline_stage_num=2, inference="colocated"), "rollout.pipeline_stage_num", "disaggregated"),
    (dict(pipeline_stage_num=0), "rollout.pipeline_stage_num", ">= 1"),
])
def test_pipeline_stage_checks(overrides, key, words):
    cfg = replace_keys(Config(), {"env.num_envs": 4, "env.num_shards": 2, "rollout.inference": "disaggregated",
                                  **{f"rollout.{k}": v for k, v in overrides.items()}})
    with pytest.raises(ConfigError, match=words) as err:
        check_config(cfg)
    assert err.value.key == key


def test_staleness_checks():
    cfg = replace_key(Config(), "runner.max_staleness", -1)
    with pytest.raises(ConfigError, match=">= 0"):
        check_config(cfg)
    cfg = replace_keys(Config(), {"runner.max_staleness": 1, "algorithm.num_actor_ranks": 2})
    with pytest.raises(ConfigError, match="one-rank update"):
        check_config(cfg)
    cfg = replace_key(Config(), "runner.max_staleness", 2)
    assert check_config(cfg).runner.max_staleness == 2


# ----- end to end on the real simulator -----
@pytest.mark.slow  # a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_smoke_run_with_max_staleness_one(tmp_path):
    """4 steps, eval every 2 (the pipeline drains before it), episodes of 15 steps so cursors cross steps."""
    from mlflow import MlflowClient

    from pipelines.run import main
    from storage.checkpoints import latest_checkpoint, load_checkpoint
    from storage.trajectories import TrajectoryStore
    from storage.tracking import default_tracking_uri
    assert main(["conf=smoke", f"run_root={tmp_path}", "cluster.dashboard_address=127.0.0.1:0",
                 "runner.max_staleness=1", "runner.max_steps=4", "runner.val_check_interval=2",
                 "runner.save_interval=4", "env.max_episode_steps=15", "env.ignore_terminations=true"]) == 0
    client = MlflowClient(tracking_uri=default_tracking_uri(tmp_path))
    run = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])[0]

    def hist(key):
        return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]
    assert hist("train/weight_version") == [1.0, 2.0, 3.0, 4.0]
    # step 0 on v0; step 1 on v0 while update 0 ran; eval after step 2 drains: step 2 on v2, step 3 on v2
    assert hist("train/behaviour_version") == [0.0, 0.0, 2.0, 2.0]
    assert hist("train/staleness") == [0.0, 1.0, 0.0, 1.0]
    assert hist("time/overhead_share") == [] and len(hist("time/step")) == 4  # the update overlaps: no share
    beh, prox = hist("train/behaviour_logprob_mean"), hist("train/proximal_logprob_mean")
    assert beh[0] == prox[0] and beh[1] != prox[1]
    run_dir = next(p for p in (tmp_path / "smoke").iterdir() if p.is_dir())
    store = TrajectoryStore.open(run_dir / "trajectories.zarr")
    assert store.complete_steps().tolist() == [0, 1, 2, 3]
    # the shards continued across steps: 40 env steps per env, episodes of 15 -> 2 finished per env
    done = store.read("truncated")  # [E, T, B]
    assert done.sum(axis=(0, 1)).tolist() == [2, 2, 2, 2]
    ids = store.read("episode_id").reshape(-1, 4)  # [E*T, B]: non-decreasing, +4 (num_envs) per episode
    assert (np.diff(ids, axis=0) >= 0).all() and (ids[-1] - ids[0] == 8).all()
    ckpt = load_checkpoint(latest_checkpoint(run_dir))
    assert [c["episode_count"] for c in ckpt["run"]["runner"]["cursors"]] == [[2, 2]] * 2
    assert ckpt["run"]["weight_version"] == 4


@pytest.mark.slow  # timing-dependent (where the kill lands); run with `pytest -m slow`
def test_killed_env_worker_with_steps_in_flight_is_recovered(tmp_path):
    """max_staleness=1: an env worker killed while step 3 (and step 4's rollout) are in flight; every step in
    flight is cancelled, the shard re-created from the cursor and the run finishes with every step stored."""
    import os
    import signal
    import threading
    import time

    from pipelines.clusters import start_cluster
    from pipelines.config import load_config
    from pipelines.runner import Runner
    from storage.trajectories import TrajectoryStore
    cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}", "runner.max_steps=6", "rollout.chunk_steps=40",
                          "rollout.chunk_steps_per_node=20", "runner.save_interval=6", "runner.val_check_interval=6",
                          "runner.max_staleness=1", "cluster.dashboard_address=127.0.0.1:0"])
    handle = start_cluster(cfg)
    try:
        runner = Runner(cfg, handle, echo=lambda *a: None)
        pids = handle.client.run(os.getpid)
        addr = runner.placement.shard_workers[1]
        killed = []

        def killer():
            while runner.state.step < 3:
                time.sleep(0.02)
            time.sleep(0.3)
            os.kill(pids[addr], signal.SIGKILL)
            killed.append(runner.state.step)

        threading.Thread(target=killer, daemon=True).start()
        res = runner.run()
        assert killed and res.steps == 6
        assert sum(v for _, v in runner.tracker.get_metric_history("train/retries")) == 1.0
        assert TrajectoryStore.open(res.store_path).complete_steps().tolist() == list(range(6))
        versions = [v for _, v in runner.tracker.get_metric_history("train/weight_version")]
        assert versions == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    finally:
        handle.close()
