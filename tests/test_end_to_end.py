"""End-to-end smoke run: `conf=smoke` on the real ManiSkill PushCube-v1 through a real local Dask cluster, then a
resume of the same run. Checks what a user looks at afterwards: MLflow, the zarr trajectories, the checkpoints.

smoke: 4 envs in 2 shards, T=10 chunk steps of C=1 action, 3 training steps, eval and checkpoint at step 3.
"""
from __future__ import annotations

import json
import math

import dask.array as da
import numpy as np
import pytest
from mlflow import MlflowClient

from pipelines.run import main
from storage.checkpoints import latest_checkpoint, list_checkpoints, load_checkpoint
from storage.tracking import default_tracking_uri
from storage.trajectories import TrajectoryStore


def _run(tmp_path, *extra):
    return main(["conf=smoke", f"run_root={tmp_path}", "cluster.dashboard_address=127.0.0.1:0", *extra])


def _history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.fixture(scope="module")
def smoke(smoke_run):
    """The suite's one `_run(root)` (tests/conftest.py `smoke_run`; test_vla_recipe.py records from it too)."""
    root = smoke_run
    client = MlflowClient(tracking_uri=default_tracking_uri(root))
    exp = client.get_experiment_by_name("smoke")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run_dirs = sorted(p for p in (root / "smoke").iterdir() if p.is_dir())
    assert len(run_dirs) == 1
    return root, client, runs[0], run_dirs[0]


def test_smoke_run_logs_params_and_metrics(smoke):
    root, client, run, _ = smoke
    assert run.info.status == "FINISHED"
    p = run.data.params
    assert p["env.env_id"] == "PushCube-v1" and p["experiment"] == "smoke" and p["env.num_envs"] == "4"
    assert p["rollout.chunk_steps"] == "10" and p["policy.hidden_sizes"] == "[256, 256, 256]"
    rid = run.info.run_id
    for key in ("train/actor_loss", "train/critic_loss", "rollout/env_steps_per_s", "time/step",
                "time/overhead_share", "env/num_episodes", "train/weight_version"):  # synchronous: a share
        hist = _history(client, rid, key)
        assert [s for s, _ in hist] == [1, 2, 3], key
        assert all(math.isfinite(v) for _, v in hist), key
    assert [v for _, v in _history(client, rid, "train/weight_version")] == [1.0, 2.0, 3.0]
    assert [v for _, v in _history(client, rid, "rollout/env_steps_total")] == [40.0, 80.0, 120.0]
    # 30 env steps per env: no PushCube episode reaches its 50-step limit; env/* episode metrics appear only
    # when an episode ended (a success), and then env/num_episodes says so
    num_eps = _history(client, rid, "env/num_episodes")
    returns = _history(client, rid, "env/return")
    assert [s for s, v in num_eps if v > 0] == [s for s, _ in returns]
    ev = _history(client, rid, "eval/success_once")
    assert [s for s, _ in ev] == [3] and ev[0][1] in (0.0, 0.5, 1.0)  # 2 eval episodes
    assert [v for _, v in _history(client, rid, "eval/num_episodes")] == [2.0]
    assert [v for _, v in _history(client, rid, "eval/episode_len")] == [50.0]  # run to the limit in eval


def test_smoke_run_logs_weight_sync(smoke):
    """Every step each env worker's replica loads the new version once: 2 replicas x the MLP's state dict bytes,
    pulled worker to worker (tasks.weights), in well under a second each."""
    from tasks.config import family_class
    from tasks.policies import make_policy
    from tasks.weights import state_dict_nbytes
    _, client, run, _ = smoke
    nbytes = state_dict_nbytes(make_policy(family_class("policy", "mlp")(), obs_dim=35, action_dim=8, num_values=1, image_size=None,
                                           load=False).state_dict())
    assert nbytes == 4 * ((35 * 256 + 256 + 2 * (256 * 256 + 256)) * 2 + 256 * 8 + 8 + 256 + 1 + 8)
    mb = _history(client, run.info.run_id, "system/weight_sync_mb")
    assert [s for s, _ in mb] == [1, 2, 3]
    assert all(v == pytest.approx(2 * nbytes / 1e6, rel=1e-9) for _, v in mb), (mb, nbytes)
    secs = _history(client, run.info.run_id, "time/weight_sync")
    assert [s for s, _ in secs] == [1, 2, 3] and all(0.0 < v < 10.0 for _, v in secs), secs


def test_smoke_run_stores_trajectories(smoke):
    _, _, _, run_dir = smoke
    store = TrajectoryStore.open(run_dir / "trajectories.zarr")
    assert store.complete_steps().tolist() == [0, 1, 2]
    assert store.step_scalar("weight_version").tolist() == [0, 1, 2]
    assert store.step_scalar("global_step").tolist() == [0, 1, 2]
    shapes = {k: store.to_dask(k).shape for k in ("obs", "actions", "rewards", "logprobs", "values",
                                                   "step_mask", "terminated", "episode_seed")}
    assert shapes == {"obs": (3, 10, 4, 35), "actions": (3, 10, 4, 1, 8), "rewards": (3, 10, 4, 1),
                      "logprobs": (3, 10, 4, 1, 8), "values": (3, 10, 4, 1), "step_mask": (3, 10, 4, 1),
                      "terminated": (3, 10, 4), "episode_seed": (3, 10, 4)}
    obs = da.from_zarr(str(run_dir / "trajectories.zarr" / "fields" / "obs"))
    assert obs.shape == (3, 10, 4, 35) and obs.numblocks == (3, 1, 2, 1)  # one block per (step, shard)
    obs = obs.compute()
    assert np.isfinite(obs).all() and (obs != 0).any(axis=-1).all()  # every (step, t, env) was written
    rewards = store.read("rewards")
    assert ((rewards >= 0) & (rewards <= 1)).all() and store.read("step_mask").all()
    # seeds: episode 0 of env g has seed 0 + g; no episode ended within 30 steps unless it succeeded
    seeds = store.read("episode_seed")
    np.testing.assert_array_equal(seeds[0, 0], [0, 1, 2, 3])
    # the rollout continues across training steps: step 1 starts where step 0 ended (same episodes)
    assert not np.array_equal(obs[1, 0], obs[0, 0])
    assert store.attrs["env_id"] == "PushCube-v1"


def test_smoke_run_checkpoint_loads(smoke):
    _, _, run, run_dir = smoke
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "global_step_3"
    state = load_checkpoint(ckpt)
    assert state["run"]["weight_version"] == 3
    assert state["run"]["runner"]["step"] == 3 and state["run"]["runner"]["env_steps"] == 120
    assert state["run"]["runner"]["mlflow_run_id"] == run.info.run_id
    assert len(state["run"]["runner"]["cursors"]) == 2
    assert state["policy"]["actor_logstd"].shape == (8,)
    assert (run_dir / "config.yaml").read_text().startswith("experiment: smoke")


def test_smoke_run_films_its_eval_episode(smoke):
    """runner.eval_videos=1 (runner.eval_video_interval=2: step 3 films as the run's last step): the step-3 eval's
    episode 0 as an mp4 in the run dir and in MLflow under
    videos/step_3; the replay reproduced the eval's return (CPU determinism); the reset frame and one every 2nd
    action (10 fps real time), 256 px, the caption bar on top; the robot moves; the cost logged as
    time/eval_video."""
    import imageio.v2 as imageio

    from tasks.evalstats import read_evals
    from tasks.video import CAPTION_PX, frame_steps
    _, client, run, run_dir = smoke
    rid = run.info.run_id
    arts = [a.path for a in client.list_artifacts(rid, "videos/step_3")]
    assert sorted(arts) == ["videos/step_3/episode_0.mp4", "videos/step_3/videos.json"], arts
    rec = json.loads((run_dir / "videos" / "step_3" / "videos.json").read_text())
    assert rec["error"] is None and len(rec["videos"]) == 1
    v = rec["videos"][0]
    ep0 = read_evals(run_dir)[3]["episodes"][str(1_000_000)]  # eval episode 0: reset seed env.eval.seed + 0
    assert v["episode_id"] == 0 and v["seed"] == 1_000_000
    assert v["eval_return"] == pytest.approx(ep0["return"]) and v["return_matches"], v
    assert v["return"] == pytest.approx(ep0["return"], rel=1e-4, abs=1e-4)
    assert v["success_once"] == ep0["success_once"]
    frames = np.stack(imageio.mimread(run_dir / "videos" / "step_3" / "episode_0.mp4", memtest=False))
    n = len(frame_steps(ep0["episode_len"], 20.0)[0])  # PushCube-v1: 20 Hz control, filmed at 10 fps
    assert frames.shape == (n, 256, 256, 3) and v["frames"] == n and v["fps"] == 10.0
    bar = frames[:, :CAPTION_PX].astype(int)
    assert (bar.max(axis=-1) < 40).mean() > 0.7 and (bar.min(axis=-1) > 200).any()  # black bar, white text
    scene = frames[:, CAPTION_PX + 2:].astype(float)
    assert np.abs(scene[-1] - scene[0]).mean() > 1.0  # the arm moved between the reset and the last frame
    assert [s for s, _ in _history(client, rid, "time/eval_video")] == [3]
    assert [v for _, v in _history(client, rid, "eval/videos")] == [1.0]
    assert 0 < _history(client, rid, "time/eval_video")[0][1] < _history(client, rid, "time/eval")[0][1]


@pytest.mark.slow  # exact resume and one timeline are the default suite's tests/pipelines/test_resume.py; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_resume_continues_the_same_run_in_one_timeline(smoke):
    root, client, run, run_dir = smoke
    assert _run(root, "runner.resume=latest", "runner.max_steps=5") == 0
    runs = client.search_runs([run.info.experiment_id])  # active runs only
    # one active MLflow run holds the timeline: a new run continuing the checkpoint's (storage.tracking.fork),
    # the original soft-deleted and linked
    assert len(runs) == 1 and runs[0].info.run_id != run.info.run_id
    rid = runs[0].info.run_id
    assert runs[0].data.tags["dagrl.previous_run"] == run.info.run_id and runs[0].info.run_name == run.info.run_name
    assert client.get_run(run.info.run_id).info.lifecycle_stage == "deleted"
    assert client.get_run(run.info.run_id).data.tags["dagrl.superseded_by"] == rid
    assert client.get_run(rid).info.status == "FINISHED"
    assert [s for s, _ in _history(client, rid, "time/step")] == [1, 2, 3, 4, 5]
    assert [v for _, v in _history(client, rid, "train/weight_version")] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [v for _, v in _history(client, rid, "rollout/env_steps_total")] == [40.0, 80.0, 120.0, 160.0, 200.0]
    assert [s for s, _ in _history(client, rid, "eval/success_once")] == [3, 5]
    assert sorted(p for p in (root / "smoke").iterdir() if p.is_dir()) == [run_dir]  # no new run dir
    store = TrajectoryStore.open(run_dir / "trajectories.zarr")
    assert store.complete_steps().tolist() == [0, 1, 2, 3, 4]
    assert store.step_scalar("weight_version").tolist() == [0, 1, 2, 3, 4]
    assert store.to_dask("obs").shape == (5, 10, 4, 35)
    assert [p.name for p in list_checkpoints(run_dir)] == ["global_step_3", "global_step_5"]
    state = load_checkpoint(latest_checkpoint(run_dir))
    assert state["run"]["weight_version"] == 5 and state["run"]["runner"]["step"] == 5
