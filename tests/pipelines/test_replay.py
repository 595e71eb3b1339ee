"""pipelines.replay on a small real run: exact replay, tamper detection, start detection, bad input (exit 2)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from pipelines import replay
from storage.trajectories import TrajectoryStore

STORE = "trajectories.zarr"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A smoke run of 4 steps x 30 chunk steps x 4 envs: episodes (50 env steps) cross training steps."""
    from pipelines.run import main as run_main

    root = tmp_path_factory.mktemp("runs")
    rc = run_main(["conf=smoke", f"run_root={root}", "runner.max_steps=4", "rollout.chunk_steps=30",
                   "rollout.chunk_steps_per_node=15", "cluster.dashboard_address=127.0.0.1:0",
                   "runner.val_check_interval=4", "runner.save_interval=4"])  # one eval, one checkpoint
    assert rc == 0
    (store,) = root.glob(f"smoke/*/{STORE}")
    return store.parent


def _replay_json(capsys, *args) -> tuple[int, dict]:
    capsys.readouterr()
    rc = replay.main([*map(str, args), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def _copy_run(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / run_dir.name
    shutil.copytree(run_dir, dst)
    return dst


@pytest.mark.slow  # its module fixture is a 4-step cluster run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_first_complete_episode_replays_exactly(run_dir, capsys):
    rc, rep = _replay_json(capsys, run_dir, "--episodes", "0")
    assert rc == 0 and rep["all_verified"]
    (ep,) = rep["episodes"]
    assert ep["episode"] == 0 and ep["env"] == 0 and ep["seed"] == 0  # base_seed 0 + id 0
    assert ep["complete"] and ep["length"] == 50  # PushCube-v1: 50 env steps, then truncated
    assert ep["max_abs_obs_diff"] == 0.0 and ep["max_abs_reward_diff"] == 0.0
    assert ep["flag_mismatches"] == [] and ep["verified"]
    assert ep["replayed_return"] == pytest.approx(ep["stored_return"], abs=1e-9)


@pytest.mark.slow  # its module fixture is a 4-step cluster run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_run_id_lookup_and_text_report(run_dir, capsys):
    capsys.readouterr()
    rc = replay.main([run_dir.name, "--run-root", str(run_dir.parents[1]), "--episode", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "VERIFIED" in out and "1/1 episodes verified" in out and "PushCube-v1" in out


@pytest.mark.slow  # its module fixture is a 4-step cluster run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_tampered_action_is_detected(run_dir, tmp_path, capsys):
    run = _copy_run(run_dir, tmp_path)
    store = TrajectoryStore.open(run / STORE)
    ids, mask = store.read("episode_id"), store.read("step_mask")
    # episode 0 of env 0: an executed chunk step in the middle of the episode (later steps compare observations)
    e, t = 0, 10
    assert ids[e, t, 0] == 0 and mask[e, t, 0, 0]
    actions = zarr.open_array(str(run / STORE / "fields" / "actions"), mode="r+")
    a = actions[e, t, 0, 0]
    d = int(np.argmin(a))  # the smallest component: +0.5 changes it even after clipping to [-1, 1]
    assert a[d] < 0.5
    actions[e, t, 0, 0, d] = a[d] + np.float32(0.5)

    rc, rep = _replay_json(capsys, run, "--episode", "0", "--episode", "1")
    assert rc == 1 and not rep["all_verified"]
    ep, other = rep["episodes"]
    assert not ep["verified"]
    assert ep["max_abs_obs_diff"] > 1e-3  # a 0.05 rad joint target offset moves the arm
    assert other["verified"] and other["max_abs_obs_diff"] == 0.0  # the other episodes are untouched


@pytest.mark.slow  # its module fixture is a 4-step cluster run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_episode_starting_before_the_first_complete_step_is_skipped(run_dir, tmp_path, capsys):
    run = _copy_run(run_dir, tmp_path)
    complete = zarr.open_array(str(run / STORE / "steps" / "complete"), mode="r+")
    complete[0] = False  # now the store starts at step 1: episodes 0-3 started in step 0
    rc, rep = _replay_json(capsys, run, "--num-episodes", "10")
    assert rc == 0 and rep["layout"]["complete_steps"] == "1-3"
    assert {s["episode"] for s in rep["skipped"]} == {0, 1, 2, 3}
    # episodes 4-7 start at chunk step 20 of step 1 (after episode k-4 ended): replayable and complete
    assert sorted(e["episode"] for e in rep["episodes"]) == [4, 5, 6, 7]
    assert all(e["verified"] and e["max_abs_obs_diff"] == 0.0 for e in rep["episodes"])
    capsys.readouterr()
    assert replay.main([str(run), "--episode", "0"]) == 2  # asked for explicitly: bad input
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: episode 0 cannot be replayed") and "\n" not in err


@pytest.mark.slow  # its module fixture is a 4-step cluster run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_default_picks_episodes_worth_watching_and_ranges_select(run_dir, capsys):
    """No --episodes: the highest-return success, the lowest-return failure (each only if there is one), then the
    highest and lowest returns left, from the store's own rewards and success flags read here; --episodes with a
    range replays exactly those ids, in order."""
    store = TrajectoryStore.open(run_dir / STORE)
    steps = store.complete_steps()
    ids, rew, mask, succ, term, trunc = (store.read(f, steps) for f in ("episode_id", "rewards", "step_mask",
                                                                           "success", "terminated", "truncated"))
    done = term | trunc
    ret, ok, complete = {}, {}, set()
    for e, t, b in zip(*np.nonzero(mask.any(axis=-1))):  # [S, T, B] executed chunk steps
        i = int(ids[e, t, b])
        ret[i] = ret.get(i, 0.0) + float((rew[e, t, b] * mask[e, t, b]).sum())
        ok[i] = ok.get(i, False) or bool(succ[e, t, b])
        if done[e, t, b]:
            complete.add(i)
    ret = {i: r for i, r in ret.items() if i in complete}
    rc, rep = _replay_json(capsys, run_dir, "--num-episodes", "2")
    got = [e["episode"] for e in rep["episodes"]]
    assert rc == 0 and len(got) == 2 and set(got) <= set(ret)
    wins, losses = [i for i in ret if ok[i]], [i for i in ret if not ok[i]]
    want = ([max(wins, key=lambda i: (ret[i], -i))] if wins else []) + \
        ([min(losses, key=lambda i: (ret[i], i))] if losses else [])
    rest = sorted((i for i in ret if i not in want), key=lambda i: (-ret[i], i))
    want += [rest[0], rest[-1]]  # then the highest and the lowest return left
    assert got == want[:2], (got, ret, ok)
    assert rep["episodes"][0]["stored_return"] == pytest.approx(ret[want[0]])
    assert all("picked" in e for e in rep["episodes"])
    rc, rep = _replay_json(capsys, run_dir, "--episodes", "5,1-2")
    assert rc == 0 and [e["episode"] for e in rep["episodes"]] == [5, 1, 2]
    assert not any("picked" in e for e in rep["episodes"])


@pytest.mark.slow  # its module fixture is a 4-step cluster run; a long cluster run; the default suite's 20-min budget (CI runs `-m slow` as its second job)
def test_unknown_episode_id_exits_2_with_one_line(run_dir, capsys):
    capsys.readouterr()
    assert replay.main([str(run_dir), "--episode", "12345"]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert err.startswith("error: episode id 12345") and "\n" not in err and "Traceback" not in err
    assert cap.out == ""


@pytest.mark.parametrize("kind", ["missing", "not_a_store", "plain_zarr"])
def test_bad_paths_exit_2_with_one_line(tmp_path, capsys, kind):
    if kind == "missing":
        path = tmp_path / "nope" / STORE
    elif kind == "not_a_store":
        path = tmp_path / "somedir"
        path.mkdir()
        (path / "file.txt").write_text("x")
    else:
        path = tmp_path / "other.zarr"
        zarr.open_group(str(path), mode="w")
    capsys.readouterr()
    assert replay.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and str(path) in err


def test_unknown_run_id_exits_2(tmp_path, capsys):
    (tmp_path / "exp" / "20260101-000000-abcd").mkdir(parents=True)
    capsys.readouterr()
    assert replay.main(["20260101-000000-abce", "--run-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no run '20260101-000000-abce'") and "20260101-000000-abcd" in err


def test_find_episodes_start_detection():
    """Synthetic index, 1 env, T=3, steps 0 and 2 complete: ids 0,0,0 | (step 1 missing) | 0,4,4 ."""
    ids = np.array([[0], [0], [0], [0], [4], [4]])
    done = np.zeros((6, 1), bool)
    done[3] = True
    idx = replay.StoreIndex(steps=np.array([0, 2]), T=3, num_envs=1, episode_id=ids, episode_seed=ids,
                            step_mask=np.ones((6, 1, 1), bool), terminated=np.zeros((6, 1), bool), truncated=done,
                            success=np.zeros((6, 1), bool), contiguous=np.array([0, 1, 1, 0, 1, 1], bool))
    eps = replay.find_episodes(idx)
    assert list(eps) == [0, 4]
    assert eps[0].known_start and eps[0].complete and eps[0].positions == [0, 1, 2, 3]
    assert eps[4].known_start and not eps[4].complete  # follows episode 0's end at the previous chunk step


@pytest.mark.slow
def test_video_of_one_episode(run_dir, tmp_path, capsys):
    import imageio.v3 as iio

    out = tmp_path / "replay.mp4"
    rc, rep = _replay_json(capsys, run_dir, "--episode", "0", "--video", out, "--video-size", "64")
    assert rc == 0 and out.is_file()
    assert rep["video"]["frames"] == 51 and rep["video"]["render_env_max_abs_obs_diff"] == 0.0
    assert iio.imread(out).shape == (51, 64, 64, 3)


def _report(simulator: str, verified: list[bool]) -> str:
    """format_report of a replay with one episode per entry of `verified` (no simulator needed)."""
    eps = [{"episode": i, "env": i, "seed": 100 + i, "length": 50, "complete": True, "stored_return": 1.0,
            "success_once": True, "max_abs_obs_diff": 0.0 if ok else 0.2, "max_abs_reward_diff": 0.0,
            "verified": ok, "flag_mismatches": [], "notes": []} for i, ok in enumerate(verified)]
    rep = {"store": "s.zarr", "env": {"env_id": "E", "simulator": simulator, "obs_mode": "state",
                                      "control_mode": "c", "reward_mode": "r"},
           "layout": {"complete_steps": "0-1", "steps_allocated": 2, "T": 50, "num_envs": len(verified),
                      "num_action_chunks": 1},
           "episodes": eps, "tolerance": 1e-5, "replay_seconds": 0.1, "skipped": [], "notes": []}
    return replay.format_report(rep)


def test_a_maniskill_mismatch_names_the_simulator_history_as_a_possible_cause():
    """A ManiSkill training env keeps solver and contact state across reset that replay's fresh env lacks
    (benchmarks/env_history.py: 5 of 64 episodes of a default run differ), so an intact episode can show MISMATCH;
    the report says so when a ManiSkill episode mismatches, and only then (MuJoCo/LIBERO replays bit-exactly)."""
    hint = "can be the training env's history, not damage"
    assert hint in _report("maniskill", [True, False])
    assert hint not in _report("maniskill", [True, True])
    assert hint not in _report("libero", [True, False])
