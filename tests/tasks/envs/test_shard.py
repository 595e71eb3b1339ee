"""EnvShard bookkeeping on a tiny deterministic fake simulator (pure numpy, no ManiSkill).

FakeEnv: obs = [t, seed] (t = actions applied since the reset), reward = sum of the (clipped) action, terminated
when t reaches `term_at(seed)` (None: never), truncated when t reaches `limit`, success exactly on the
terminating step (so after an ignored termination success goes back to False).
"""
from __future__ import annotations

import numpy as np
import pytest

from tasks.envs.shard import EnvShard


class FakeEnv:
    obs_dim = 2

    def __init__(self, *, term_at=lambda seed: None, limit: int = 1000, action_dim: int = 2):
        self.term_at, self.limit, self.action_dim = term_at, limit, action_dim
        self.t, self.seed = 0, None
        self.reset_seeds: list[int] = []
        self.actions: list[np.ndarray] = []  # every action that reached the simulator
        self.closed = False

    def _obs(self) -> np.ndarray:
        return np.array([self.t, self.seed], np.float32)

    def reset(self, seed: int) -> np.ndarray:
        self.t, self.seed = 0, seed
        self.reset_seeds.append(seed)
        return self._obs()

    def step(self, action):
        assert action.shape == (self.action_dim,) and action.dtype == np.float32
        self.actions.append(action.copy())
        self.t += 1
        term = self.term_at(self.seed) == self.t
        trunc = self.t >= self.limit
        return self._obs(), float(action.sum()), term, trunc, term

    def close(self) -> None:
        self.closed = True


def make(envs, *, env_offset=0, num_envs_total=None, base_seed=0, auto_reset=True, ignore_terminations=False,
         episode_count=None):
    return EnvShard(envs, env_offset=env_offset, num_envs_total=num_envs_total or len(envs), base_seed=base_seed,
                    auto_reset=auto_reset, ignore_terminations=ignore_terminations, episode_count=episode_count)


def act(shard, values, C=1):
    """Chunk [B, C, D] filled per env with `values[b]` (a scalar or a length-C list)."""
    a = np.zeros((shard.num_envs, C, shard.action_dim), np.float32)
    for b, v in enumerate(values):
        a[b] = np.asarray(v, np.float32).reshape(-1, 1) if np.ndim(v) else v
    return a


def test_seeds_follow_the_rule_across_episodes_and_the_cursor_continues_them():
    # shard 1 of 2 (envs 2 and 3 of 4), every episode truncated after 2 steps
    envs = [FakeEnv(limit=2), FakeEnv(limit=2)]
    sh = make(envs, env_offset=2, num_envs_total=4, base_seed=100)
    obs = sh.current_obs()
    np.testing.assert_array_equal(obs, [[0, 102], [0, 103]])
    seeds, ids = [], []
    for _ in range(6):  # 3 episodes per env
        res = sh.chunk_step(act(sh, [0.1, 0.1]))
        seeds.append(res.episode_seed.tolist())
        ids.append(res.episode_id.tolist())
    # seed = base_seed + g + k * num_envs_total, episode id = g + k * num_envs_total
    assert seeds == [[102, 103], [102, 103], [106, 107], [106, 107], [110, 111], [110, 111]]
    assert ids == [[2, 3], [2, 3], [6, 7], [6, 7], [10, 11], [10, 11]]
    assert envs[0].reset_seeds == [102, 106, 110, 114] and envs[1].reset_seeds == [103, 107, 111, 115]
    assert sh.state_dict()["episode_count"] == [3, 3]
    # a new shard created from the counts starts exactly where this one is: episode k=3
    fresh = [FakeEnv(limit=2), FakeEnv(limit=2)]
    sh2 = make(fresh, env_offset=2, num_envs_total=4, base_seed=100, episode_count=sh.state_dict()["episode_count"])
    np.testing.assert_array_equal(sh2.current_obs(), [[0, 114], [0, 115]])
    res = sh2.chunk_step(act(sh2, [0.1, 0.1]))
    assert res.episode_seed.tolist() == [114, 115] and res.episode_id.tolist() == [14, 15]
    # the cursor is a copy, not a view of the shard's counters
    cur = sh2.state_dict()
    sh2.chunk_step(act(sh2, [0.1, 0.1]))
    assert cur["episode_count"] == [3, 3] and sh2.state_dict()["episode_count"] == [4, 4]


def test_episode_ending_inside_a_chunk_masks_the_rest_and_auto_resets():
    # env 0 (seed 0) terminates after its 2nd action; env 1 (seed 1) keeps going
    envs = [FakeEnv(term_at=lambda s: 2 if s == 0 else None) for _ in range(2)]
    sh = make(envs)
    a = act(sh, [[0.1, 0.2, 0.3], [0.1, 0.2, 0.3]], C=3)
    a[1, 2] = 5.0  # clipped to 1.0 before the simulator
    res = sh.chunk_step(a)
    np.testing.assert_allclose(res.rewards, [[0.2, 0.4, 0.0], [0.2, 0.4, 2.0]], rtol=1e-6)
    assert res.rewards[0, 2] == 0.0
    np.testing.assert_array_equal(res.step_mask, [[True, True, False], [True, True, True]])
    assert res.terminated.tolist() == [True, False] and res.truncated.tolist() == [False, False]
    assert res.success.tolist() == [True, False]
    np.testing.assert_array_equal(res.final_obs, [[2, 0], [0, 0]])  # obs at the end; zeros where not ended
    np.testing.assert_array_equal(res.obs, [[0, 2], [3, 1]])  # env 0 auto-reset with its next seed 0 + 0 + 1*2
    assert res.episode_seed.tolist() == [0, 1] and res.episode_id.tolist() == [0, 1]
    assert len(envs[0].actions) == 2 and len(envs[1].actions) == 3  # the 3rd action of env 0 never ran
    np.testing.assert_array_equal(envs[1].actions[2], [1.0, 1.0])
    assert res.episodes == [{"env": 0, "seed": 0, "episode_id": 0, "task_id": 0, "trial_id": -1, "return": pytest.approx(0.6),
                             "episode_len": 2, "success_once": True, "success_at_end": True}]
    assert res.obs.dtype == np.float32 and res.final_obs.dtype == np.float32
    # the next chunk belongs to env 0's second episode
    res2 = sh.chunk_step(act(sh, [0.0, 0.0], C=3))
    assert res2.episode_seed.tolist() == [2, 1] and res2.episode_id.tolist() == [2, 1]
    np.testing.assert_array_equal(res2.obs, [[3, 2], [6, 1]])
    assert envs[0].reset_seeds == [0, 2]


def test_episode_ending_on_the_last_action_of_a_chunk():
    envs = [FakeEnv(term_at=lambda s: None, limit=3)]
    sh = make(envs)
    res = sh.chunk_step(act(sh, [[0.5, 0.5, 0.5]], C=3))
    assert res.step_mask.tolist() == [[True, True, True]]
    assert res.truncated.tolist() == [True] and res.terminated.tolist() == [False]
    np.testing.assert_array_equal(res.final_obs, [[3, 0]])
    np.testing.assert_array_equal(res.obs, [[0, 1]])
    assert res.episodes[0]["episode_len"] == 3 and res.episodes[0]["return"] == pytest.approx(3.0)
    assert res.episodes[0]["success_once"] is False and res.episodes[0]["success_at_end"] is False


def test_terminated_and_truncated_are_never_both():
    # termination and the time limit on the same step: it is a termination (no bootstrap)
    sh = make([FakeEnv(term_at=lambda s: 2, limit=2)])
    sh.chunk_step(act(sh, [0.1]))
    res = sh.chunk_step(act(sh, [0.1]))
    assert res.terminated.tolist() == [True] and res.truncated.tolist() == [False]
    # a sweep of episode lengths and chunk sizes: each ending is exactly one of the two
    rng = np.random.default_rng(0)
    for C in (1, 2, 3, 5):
        envs = [FakeEnv(term_at=lambda s: s % 7 + 1 if s % 3 else None, limit=6) for _ in range(4)]
        sh = make(envs, base_seed=int(rng.integers(100)))
        ends = {"term": 0, "trunc": 0}
        for _ in range(20):
            res = sh.chunk_step(rng.uniform(-1, 1, (4, C, 2)).astype(np.float32))
            assert not (res.terminated & res.truncated).any()
            ends["term"] += int(res.terminated.sum())
            ends["trunc"] += int(res.truncated.sum())
            # every ended env reported exactly one episode
            assert len(res.episodes) == int((res.terminated | res.truncated).sum())
        assert ends["term"] > 0 and ends["trunc"] > 0


def test_ignore_terminations_runs_to_the_time_limit():
    # success (and termination) on step 2; time limit 5
    def run(ignore):
        sh = make([FakeEnv(term_at=lambda s: 2, limit=5)], ignore_terminations=ignore)
        out = [sh.chunk_step(act(sh, [0.25])) for _ in range(5)]
        return sh, out

    sh, out = run(ignore=False)
    assert [r.terminated[0] for r in out][:2] == [False, True]
    assert out[1].episodes[0]["episode_len"] == 2

    sh, out = run(ignore=True)
    assert [bool(r.terminated[0]) for r in out] == [False] * 5
    assert [bool(r.truncated[0]) for r in out] == [False, False, False, False, True]
    assert [bool(r.success[0]) for r in out] == [False, True, False, False, False]
    assert [len(r.episodes) for r in out] == [0, 0, 0, 0, 1]
    ep = out[4].episodes[0]
    assert ep == {"env": 0, "seed": 0, "episode_id": 0, "task_id": 0, "trial_id": -1, "return": pytest.approx(2.5), "episode_len": 5,
                  "success_once": True, "success_at_end": False}
    np.testing.assert_array_equal(out[4].final_obs, [[5, 0]])
    assert sh.envs[0].reset_seeds == [0, 1]


def test_without_auto_reset_a_finished_env_idles_until_the_rollout_ends():
    # env 0 (seed 0) terminates at step 2, env 1 (seed 1) at step 4
    envs = [FakeEnv(term_at=lambda s: {0: 2, 1: 4}.get(s)) for _ in range(2)]
    sh = make(envs, auto_reset=False)
    sh.begin_rollout()
    out = [sh.chunk_step(act(sh, [0.5, 0.25])) for _ in range(6)]
    assert [r.terminated.tolist() for r in out[:4]] == [[False, False], [True, False], [False, False],
                                                        [False, True]]
    # chunks 3 and 4: env 0 is idle (nothing executed, reward 0, obs stays the final obs)
    for r in out[2:4]:
        assert r.step_mask[0].tolist() == [False] and r.rewards[0, 0] == 0.0
        assert r.step_mask[1].tolist() == [True] and r.rewards[1, 0] == pytest.approx(0.5)  # 2 dims x 0.25
        assert not r.terminated[0] and not r.truncated[0]
        assert all(e["env"] == 1 for e in r.episodes)
        np.testing.assert_array_equal(r.obs[0], [2, 0])
    # chunks 5 and 6: every env has finished; nothing is reset or executed until the rollout ends
    assert len(envs[0].actions) == 2 and len(envs[1].actions) == 4
    assert envs[0].reset_seeds == [0] and envs[1].reset_seeds == [1]
    for r in out[4:]:
        assert r.episode_seed.tolist() == [-1, -1] and not r.step_mask.any() and r.episodes == []
        np.testing.assert_array_equal(r.obs, [[2, 0], [4, 1]])
    eps = [e for r in out for e in r.episodes]
    assert [(e["env"], e["episode_len"], e["return"]) for e in eps] == [(0, 2, 2.0), (1, 4, 2.0)]
    # the next rollout starts episode k=1 in every env
    sh.begin_rollout()
    assert envs[0].reset_seeds == [0, 2] and envs[1].reset_seeds == [1, 3]
    res = sh.chunk_step(act(sh, [0.5, 0.25]))
    assert res.episode_seed.tolist() == [2, 3] and res.episode_id.tolist() == [2, 3]
    assert res.step_mask.tolist() == [[True], [True]]
    np.testing.assert_array_equal(res.obs, [[1, 2], [1, 3]])


def test_reset_all_starts_every_env_fresh():
    envs = [FakeEnv(limit=10), FakeEnv(limit=10)]
    sh = make(envs, base_seed=5)
    sh.chunk_step(act(sh, [0.1, 0.1]))
    obs = sh.reset_all()  # same episode index (none ended): the same seeds again
    np.testing.assert_array_equal(obs, [[0, 5], [0, 6]])
    res = sh.chunk_step(act(sh, [0.1, 0.1]))
    assert res.episodes == [] and res.episode_seed.tolist() == [5, 6]


def test_episode_metrics_accumulate_over_chunks():
    sh = make([FakeEnv(term_at=lambda s: 4, limit=10)])
    out = [sh.chunk_step(act(sh, [[0.5, -0.25, 1.5]], C=3)) for _ in range(2)]
    # actions applied: 0.5, -0.25, 1.0 (clipped), 0.5 -> terminated at step 4 of the episode
    assert out[0].episodes == []
    assert out[1].step_mask.tolist() == [[True, False, False]]
    np.testing.assert_allclose(out[1].rewards, [[1.0, 0.0, 0.0]])
    assert out[1].episodes == [{"env": 0, "seed": 0, "episode_id": 0, "task_id": 0, "trial_id": -1, "return": pytest.approx(3.5),
                                "episode_len": 4, "success_once": True, "success_at_end": True}]


@pytest.mark.parametrize("shape", [(2, 2), (3, 1, 2), (2, 1, 3), (2, 1, 2, 1)])
def test_wrong_action_shape_is_an_error(shape):
    sh = make([FakeEnv(), FakeEnv()])
    with pytest.raises(ValueError, match=r"actions must be \[B=2, C, D=2\]"):
        sh.chunk_step(np.zeros(shape, np.float32))


def test_constructor_errors_and_close():
    with pytest.raises(ValueError, match="at least one env"):
        make([], num_envs_total=1)
    with pytest.raises(ValueError, match="episode_count"):
        make([FakeEnv(), FakeEnv()], episode_count=[0, 0, 0])
    envs = [FakeEnv(), FakeEnv()]
    make(envs).close()
    assert all(e.closed for e in envs)


def test_grpo_groups_share_every_reset_seed_and_never_straddle_shards():
    # shard 1 of 2 of 8 envs in groups of 2: envs 4,5 = group 2 and envs 6,7 = group 3; 4 groups in the run
    envs = [FakeEnv(limit=1) for _ in range(4)]
    sh = EnvShard(envs, env_offset=4, num_envs_total=8, base_seed=100, auto_reset=True, ignore_terminations=False,
                  group_size=2)
    sh.chunk_step(act(sh, [0, 0, 0, 0]))  # every episode ends after one step and auto-resets
    assert [e.reset_seeds for e in envs] == [[102, 106], [102, 106], [103, 107], [103, 107]]
    with pytest.raises(ValueError, match="straddle"):
        EnvShard([FakeEnv() for _ in range(3)], env_offset=3, num_envs_total=6, base_seed=0, auto_reset=True,
                 ignore_terminations=False, group_size=2)


class TaskEnv(FakeEnv):
    """A multi-task FakeEnv: the reset seed picks task seed % 3 and trial seed // 3 (as a LIBERO adapter would)."""

    task_id = trial_id = None

    def reset(self, seed: int) -> np.ndarray:
        self.task_id, self.trial_id = seed % 3, seed // 3
        return super().reset(seed)


@pytest.mark.parametrize("auto_reset", [True, False])
def test_task_and_trial_ids_follow_each_envs_episode(auto_reset):
    # 2 envs, episodes truncated after 2 actions; seeds base + g + k*2 -> env 0: 0, 2, 4; env 1: 1, 3, 5
    envs = [TaskEnv(limit=2), TaskEnv(limit=2)]
    sh = make(envs, auto_reset=auto_reset)
    sh.begin_rollout()
    task, trial = sh.current_tasks()
    assert task.tolist() == [0, 1] and trial.tolist() == [0, 0]  # seeds 0, 1
    res = sh.chunk_step(act(sh, [1, 1], C=2))
    assert res.trial_id.tolist() == [0, 0]  # the episodes the chunk belonged to
    assert [(e["task_id"], e["trial_id"]) for e in res.episodes] == [(0, 0), (1, 0)]
    if auto_reset:  # obs is the new episode's (seeds 2, 3): its task prompts the next chunk
        assert res.task_id.tolist() == [2, 0] and sh.current_tasks()[1].tolist() == [0, 1]
    else:  # idle: the last episode's task stays (the prompt of the idle obs), no trial
        assert res.task_id.tolist() == [0, 1] and sh.current_tasks()[1].tolist() == [-1, -1]
        sh.begin_rollout()
        assert sh.current_tasks()[0].tolist() == [2, 0] and sh.current_tasks()[1].tolist() == [0, 1]
    # a shard rebuilt from the cursor re-simulates and reports the same tasks
    sh2 = make([TaskEnv(limit=2), TaskEnv(limit=2)], auto_reset=auto_reset)
    sh2.load_state_dict(sh.state_dict())
    assert [a.tolist() for a in sh2.current_tasks()] == [a.tolist() for a in sh.current_tasks()]


def test_envs_without_task_attributes_are_task_0_without_trials():
    sh = make([FakeEnv(limit=1)], auto_reset=False)
    sh.begin_rollout()
    res = sh.chunk_step(act(sh, [0]))
    assert res.task_id.tolist() == [0] and res.trial_id.tolist() == [-1]
    assert (res.episodes[0]["task_id"], res.episodes[0]["trial_id"]) == (0, -1)
