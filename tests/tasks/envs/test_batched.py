"""BatchedEnvShard (one simulator instance holding all envs, GPU simulation) against EnvShard on the same fake
dynamics: every ChunkResult field, the episodes, seeds and cursors must be identical, for auto_reset on/off,
ignore_terminations on/off, chunks in which episodes end mid-chunk, and images. The ManiSkill GPU adapter itself
is checked by a `gpu` test (skipped without CUDA)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.envs.batched import BatchedEnvShard
from tasks.envs.shard import EnvShard


class FakeEnv:
    """obs = [t, seed]; reward = sum of the action + seed/1000; terminated at t = 2 + seed % 3 (success), truncated
    at t = 5; image = t everywhere."""

    obs_dim, action_dim, image_shape = 2, 2, (2, 2, 3)

    def __init__(self):
        self.t, self.seed = 0, 0

    def _obs(self):
        return np.array([self.t, self.seed], np.float32)

    def reset(self, seed):
        self.t, self.seed = 0, int(seed)
        return self._obs()

    def step(self, action):
        self.t += 1
        term = self.t == 2 + self.seed % 3
        return self._obs(), float(action.sum()) + self.seed / 1000, term, self.t >= 5, term

    def render_rgb(self):
        return np.full(self.image_shape, self.t, np.uint8)

    def close(self):
        pass


class FakeBatched:
    """The BatchedEnv protocol over B FakeEnvs: every env steps at every call (as a GPU simulator does)."""

    obs_dim, action_dim, image_shape = 2, 2, (2, 2, 3)

    def __init__(self, B):
        self.envs = [FakeEnv() for _ in range(B)]
        self.num_envs = B
        self.stepped = 0

    def reset(self, seeds, env_idx):
        return np.stack([self.envs[i].reset(s) for s, i in zip(seeds, env_idx)])

    def step(self, actions):
        assert actions.shape == (self.num_envs, 2) and actions.dtype == np.float32
        self.stepped += 1
        out = [e.step(a) for e, a in zip(self.envs, actions)]
        return tuple(np.array([o[i] for o in out]) for i in range(5))

    def render_rgb(self):
        return np.stack([e.render_rgb() for e in self.envs])

    def close(self):
        pass


def _pair(B=4, **kw):
    common = dict(env_offset=4, num_envs_total=8, base_seed=10, **kw)
    return EnvShard([FakeEnv() for _ in range(B)], **common), BatchedEnvShard(FakeBatched(B), **common)


def _assert_same(a, b):
    for f in ("obs", "rewards", "terminated", "truncated", "step_mask", "success", "final_obs", "episode_seed",
              "episode_id", "rgb", "final_rgb"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert a.episodes == b.episodes


@pytest.mark.parametrize("auto_reset", [True, False])
@pytest.mark.parametrize("ignore_terminations", [False, True])
@pytest.mark.parametrize("C", [1, 3])
def test_batched_shard_matches_the_per_env_shard(auto_reset, ignore_terminations, C):
    ref, bat = _pair(auto_reset=auto_reset, ignore_terminations=ignore_terminations)
    np.testing.assert_array_equal(ref.reset_all(), bat.reset_all())
    rng = np.random.default_rng(0)
    n_eps = partial = 0
    for t in range(24):
        if t % 6 == 0:  # rollouts of 6 chunk steps (without auto_reset: new episodes, open ones cut)
            ref.begin_rollout(), bat.begin_rollout()
            np.testing.assert_array_equal(ref.current_obs(), bat.current_obs())
            np.testing.assert_array_equal(ref.current_rgb(), bat.current_rgb())
        actions = rng.uniform(-1.5, 1.5, (4, C, 2)).astype(np.float32)
        a, b = ref.chunk_step(actions), bat.chunk_step(actions)
        _assert_same(a, b)
        n_eps += len(a.episodes)
        partial += int((a.step_mask.any(1) & ~a.step_mask.all(1)).any())  # an episode ended mid-chunk
        np.testing.assert_array_equal(ref.active, bat.active)
        assert ref.needs_reset == bat.needs_reset
    # the batched shard keeps no action log (it cannot replay GPU physics); the rest of the cursors agree
    assert {**ref.state_dict(), "actions": None} == {**bat.state_dict(), "actions": None}
    assert n_eps >= 8  # episodes did end, so the comparison covered the resets
    assert (partial > 0) == (C == 3)  # and with chunks of 3, some mid-chunk


def test_a_chunk_ending_mid_way_masks_the_rest_and_steps_idle_envs_with_zero_actions():
    _, bat = _pair(B=2, auto_reset=True, ignore_terminations=False)
    bat.reset_all()  # seeds 14, 15: terminations at t = 4 and t = 2
    res = bat.chunk_step(np.ones((2, 3, 2), np.float32))
    np.testing.assert_array_equal(res.step_mask, [[True, True, True], [True, True, False]])
    np.testing.assert_array_equal(res.terminated, [False, True])
    assert res.rewards[1, 2] == 0.0 and res.rewards[0, 2] == pytest.approx(2 + 14 / 1000)
    assert bat.env.stepped == 3  # a batched simulator steps every env; env 1's third step was a discarded no-op
    assert res.episodes[0]["seed"] == 15 and res.episodes[0]["episode_len"] == 2
    assert bat.seed[1] == 15 + 8  # auto-reset with the next seed of the rule (base + g + k * num_envs_total)


def test_cursor_continues_the_seed_sequence():
    ref, bat = _pair(auto_reset=True, ignore_terminations=True, episode_count=[2, 0, 1, 3])
    np.testing.assert_array_equal(ref.reset_all(), bat.reset_all())
    np.testing.assert_array_equal(bat.seed, [10 + 4 + 16, 10 + 5, 10 + 6 + 8, 10 + 7 + 24])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ManiSkill physx_cuda)")
def test_maniskill_gpu_shard_steps_many_envs_in_one_instance():
    from tasks.envs.maniskill.configuration import ManiSkillEnvConfig
    from tasks.envs import make_shard
    from tasks.envs.maniskill.adapter import ManiSkillBatchedEnv, physx_gpu_library
    lib, url = physx_gpu_library()
    if not lib.is_file():  # the config check refuses it (test_maniskill); SAPIEN would download it
        pytest.skip(f"SAPIEN's GPU PhysX library {lib} is missing (from {url})")
    cfg = ManiSkillEnvConfig(sim_backend="physx_cuda", num_envs=64, num_shards=2)
    sh = make_shard(cfg, shard=1, num_shards=2, num_envs=64, auto_reset=True, ignore_terminations=True, base_seed=0)
    assert isinstance(sh, BatchedEnvShard) and isinstance(sh.env, ManiSkillBatchedEnv)
    assert sh.env.num_envs == 32 and sh.env.device.type == "cuda"
    obs = sh.reset_all()
    assert obs.shape == (32, sh.obs_dim) and np.isfinite(obs).all()
    total = 0
    for _ in range(30):  # PushCube-v1: 50-step episodes, truncated and auto-reset in the chunk that ends them
        res = sh.chunk_step(np.random.default_rng(0).uniform(-1, 1, (32, 2, sh.action_dim)).astype(np.float32))
        assert res.rewards.shape == (32, 2) and np.isfinite(res.rewards).all()
        total += len(res.episodes)
    assert total == 32  # every env finished its first episode at step 50 (chunk 25)
    assert sh.state_dict()["episode_count"] == [1] * 32
    sh.close()
