"""env.fast_step (tasks.envs.maniskill.fast_step) against ManiSkill's own step on the real simulator: the same values, bit
for bit, including success, the reward's "reached" branch, terminations and truncations; and where it does not apply.
"""
from __future__ import annotations

import numpy as np
import pytest

from tasks.envs.maniskill.configuration import ManiSkillEnvConfig
from tasks.envs import make_shard
from tasks.envs.maniskill.adapter import ManiSkillEnv


def _pair(env_id: str = "PushCube-v1", **kw):
    ref = ManiSkillEnv(ManiSkillEnvConfig(env_id=env_id, fast_step=False, **kw))
    fast = ManiSkillEnv(ManiSkillEnvConfig(env_id=env_id, **kw))
    assert ref._fast_step is None and fast._fast_step is not None
    return ref, fast


def _same(a, b, i) -> None:
    assert np.array_equal(a[0], b[0]) and a[0].dtype == b[0].dtype == np.float32, (i, np.abs(a[0] - b[0]).max())
    assert a[1:] == b[1:] and isinstance(b[1], float), (i, a[1:], b[1:])


def _teleport(env: ManiSkillEnv, where: str, dz: float = 0.0) -> None:
    """Move the cube: into the goal region (success), or 2.5 cm ahead of the TCP, where the dense reward's push pose
    is (its "reached" branch, d < 1 cm)."""
    import sapien
    base = env.env.unwrapped
    if where == "goal":
        gx, gy = base.goal_region.pose.p[0, :2].tolist()
        base.obj.set_pose(sapien.Pose(p=[gx, gy, base.cube_half_size]))
    else:
        tx, ty, tz = base.agent.tcp.pose.p[0].tolist()
        base.obj.set_pose(sapien.Pose(p=[tx + base.cube_half_size + 0.005, ty, tz + dz]))


def _reached(env: ManiSkillEnv) -> bool:
    """The dense reward's condition, from ManiSkill's own poses: the TCP within 1 cm of the push pose."""
    base = env.env.unwrapped
    push = base.obj.pose.p[0].numpy() + np.array([-base.cube_half_size - 0.005, 0, 0], np.float32)
    return float(np.linalg.norm(push - base.agent.tcp.pose.p[0].numpy())) < 0.01


@pytest.mark.parametrize("reward_mode", ["normalized_dense", "dense"])
def test_fast_step_equals_maniskills_step_bit_for_bit(reward_mode):
    ref, fast = _pair(reward_mode=reward_mode)
    rng = np.random.default_rng(3)
    assert np.array_equal(ref.reset(11), fast.reset(11))
    counts = dict(steps=0, success=0, reached=0, terminated=0, truncated=0)
    for i in range(400):
        phase = i % 50
        action = rng.uniform(-1, 1, ref.action_dim).astype(np.float32)
        if phase in (10, 30):  # success: the cube set into the goal region
            for env in (ref, fast):
                _teleport(env, "goal")
        elif 20 <= phase < 26:  # reached: the cube set in front of the held TCP (it falls for one control step)
            action[:] = 0.0
            for env in (ref, fast):
                _teleport(env, "tcp", dz=0.002 * (phase - 20))
        a, b = ref.step(action), fast.step(action)
        _same(a, b, i)
        counts["steps"] += 1
        counts["success"] += a[4]
        counts["reached"] += _reached(ref) and not a[4]
        counts["terminated"] += a[2]
        counts["truncated"] += a[3]
        if a[2] or a[3]:
            seed = 100 + i
            assert np.array_equal(ref.reset(seed), fast.reset(seed))
    # every branch was exercised: success (reward 1 / 4), the reached bonus, both ways an episode ends
    assert counts["success"] >= 2 and counts["reached"] >= 1, counts
    assert counts["terminated"] >= 2, counts
    ref.close(), fast.close()


def test_truncation_at_the_time_limit_and_the_elapsed_steps_as_maniskills():
    ref, fast = _pair(max_episode_steps=7)
    for env in (ref, fast):
        env.reset(5)
    zeros = np.zeros(ref.action_dim, np.float32)
    outs = [(ref.step(zeros), fast.step(zeros)) for _ in range(7)]
    assert [o[1][3] for o in outs] == [False] * 6 + [True]
    assert all(a[1:] == b[1:] and np.array_equal(a[0], b[0]) for a, b in outs)
    assert int(fast.env.unwrapped.elapsed_steps[0]) == int(ref.env.unwrapped.elapsed_steps[0]) == 7
    ref.close(), fast.close()


def test_shards_with_and_without_fast_step_give_the_same_rollout():
    """The whole adapter path (EnvShard, action chunks, auto_reset): the same ChunkResults either way."""
    actions = np.random.default_rng(1).uniform(-1, 1, (30, 2, 4, 8)).astype(np.float32)
    results = []
    for fast_step in (False, True):
        sh = make_shard(ManiSkillEnvConfig(env_id="PushCube-v1", fast_step=fast_step, max_episode_steps=20), shard=0,
                        num_shards=1, num_envs=2, auto_reset=True, ignore_terminations=False, base_seed=9)
        assert (sh.envs[0]._fast_step is not None) == fast_step
        results.append([sh.chunk_step(a) for a in actions])
        sh.close()
    ends = 0
    for a, b in zip(*results):
        for field in ("obs", "rewards", "terminated", "truncated", "step_mask", "success", "final_obs",
                      "episode_seed", "episode_id"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        ends += len(a.episodes)
    assert ends >= 4  # 30 chunks of 4 actions in 20-step episodes: episodes end and reset inside the rollout


def test_pickcube_fast_step_equals_maniskills_step_with_grasps_and_successes():
    """PickCube-v1: the grasp flag (in the observation and the reward), the placed-and-static success, the
    arm-static bonus, terminations: all as ManiSkill's step."""
    import sapien
    ref, fast = _pair("PickCube-v1")
    rng = np.random.default_rng(5)
    ref.reset(21), fast.reset(21)
    counts = dict(grasped=0, success=0, placed_moving=0, terminated=0)
    for i in range(300):
        phase = i % 50
        action = rng.uniform(-1, 1, ref.action_dim).astype(np.float32)
        if 5 <= phase < 20:  # the cube held between the open fingers while they close: a grasp
            action[:7], action[7] = 0.0, -1.0
            if phase < 8:
                for env in (ref, fast):
                    base = env.env.unwrapped
                    base.cube.set_pose(sapien.Pose(p=base.agent.tcp.pose.p[0].tolist()))
        elif 30 <= phase < 40:  # the cube at the goal: placed, the arm moving (35-39: held still, success)
            action[:] *= 0.0 if phase >= 35 else 1.0
            for env in (ref, fast):
                base = env.env.unwrapped
                base.cube.set_pose(sapien.Pose(p=base.goal_site.pose.p[0].tolist()))
        a, b = ref.step(action), fast.step(action)
        _same(a, b, i)
        counts["grasped"] += bool(ref.env.unwrapped.agent.is_grasping(ref.env.unwrapped.cube)[0])
        counts["success"] += a[4]
        counts["placed_moving"] += 30 <= phase < 35 and not a[4]
        counts["terminated"] += a[2]
        if a[2] or a[3]:
            assert np.array_equal(ref.reset(300 + i), fast.reset(300 + i))
    assert counts["grasped"] >= 3 and counts["success"] >= 1 and counts["terminated"] >= 1, counts
    assert counts["placed_moving"] >= 3, counts  # the arm-static bonus of a placed cube
    ref.close(), fast.close()


@pytest.mark.parametrize("env_id, control_mode", [("StackCube-v1", "pd_joint_delta_pos"),
                                                  ("PushCube-v1", "pd_ee_delta_pose")])
def test_one_part_fast_the_other_maniskills(env_id, control_mode):
    """An env task without a computation here (StackCube-v1: ManiSkill's observation and reward after the fast
    controller), a controller without a fast path (pd_ee_delta_pose: ManiSkill's controller, PushCube's
    computation): the same values as ManiSkill's step."""
    ref, fast = _pair(env_id, control_mode=control_mode)
    rng = np.random.default_rng(2)
    ref.reset(4), fast.reset(4)
    for i in range(60):
        action = rng.uniform(-1, 1, ref.action_dim).astype(np.float32)
        a, b = ref.step(action), fast.step(action)
        _same(a, b, i)
        if a[2] or a[3]:
            ref.reset(50 + i), fast.reset(50 + i)
    ref.close(), fast.close()


@pytest.mark.parametrize("kw", [dict(env_id="StackCube-v1", control_mode="pd_ee_delta_pose"),
                                dict(env_id="PushCube-v1", control_mode="pd_ee_delta_pose", reward_mode="sparse"),
                                dict(env_id="PushCube-v1", fast_step=False)])
def test_no_fast_path_falls_back_to_maniskills_step(kw):
    env = ManiSkillEnv(ManiSkillEnvConfig(**kw))
    assert env._fast_step is None  # nothing tasks.envs.maniskill.fast_step covers, or env.fast_step=false
    env.reset(0)
    obs, r, term, trunc, succ = env.step(np.zeros(env.action_dim, np.float32))
    assert obs.shape == (env.obs_dim,) and np.isfinite(r)
    env.close()
