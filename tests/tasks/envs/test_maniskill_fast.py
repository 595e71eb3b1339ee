"""env.fast_step (tasks.envs.maniskill_fast) against ManiSkill's own step on the real simulator: the same values, bit
for bit, including success, the reward's "reached" branch, terminations and truncations; and where it does not apply.
"""
from __future__ import annotations

import numpy as np
import pytest

from tasks.config import EnvConfig
from tasks.envs import make_shard
from tasks.envs.maniskill import ManiSkillEnv


def _pair(**kw):
    cfg = EnvConfig(env_id="PushCube-v1", **kw)
    ref = ManiSkillEnv(EnvConfig(env_id="PushCube-v1", fast_step=False, **kw))
    fast = ManiSkillEnv(cfg)
    assert ref._fast_step is None and fast._fast_step is not None
    return ref, fast


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
        assert np.array_equal(a[0], b[0]) and a[0].dtype == b[0].dtype == np.float32, i
        assert a[1:] == b[1:] and isinstance(b[1], float), (i, a[1:], b[1:])
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
        sh = make_shard(EnvConfig(env_id="PushCube-v1", fast_step=fast_step, max_episode_steps=20), shard=0,
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


@pytest.mark.parametrize("kw", [dict(env_id="PickCube-v1"), dict(reward_mode="sparse")])
def test_no_fast_path_falls_back_to_maniskills_step(kw):
    env = ManiSkillEnv(EnvConfig(**{"env_id": "PushCube-v1", **kw}))
    assert env._fast_step is None  # an env task / reward mode tasks.envs.maniskill_fast does not cover
    env.reset(0)
    obs, r, term, trunc, succ = env.step(np.zeros(env.action_dim, np.float32))
    assert obs.shape == (env.obs_dim,) and np.isfinite(r)
    env.close()
