"""tasks.replay on a fake deterministic env and a hand-built storage.episodes index: no store, no Dask.

The fake env: obs = [seed + sum of executed actions], reward = the action, terminated once the sum reaches 3, so
every stored value follows from (seed, actions) by hand."""
from __future__ import annotations

import numpy as np

from storage.episodes import EpisodeData, StoreIndex, find_episodes
from tasks.replay import replay_episode


class SumEnv:
    def reset(self, seed: int) -> np.ndarray:
        self.x = float(seed)
        self.s = 0.0
        return np.array([self.x], np.float32)

    def step(self, a):
        self.s += float(a[0])
        self.x += float(a[0])
        return np.array([self.x], np.float32), float(a[0]), self.s >= 3.0, False, self.s >= 3.0


def _episode(actions):
    """One env, T=3 chunk steps of C=2 actions in one complete step; episode 0 with seed 10."""
    T, C = 3, 2
    acts = np.asarray(actions, np.float32).reshape(T, C, 1)
    # by hand: sums after each action 1, 2 | 3 (terminated at the first action of chunk step 1)
    obs = np.array([[10.0], [12.0], [0.0]], np.float32)  # before chunk steps 0, 1 (chunk step 2: next episode)
    rewards = np.array([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], np.float32)
    mask = np.array([[True, True], [True, False], [False, False]])
    idx = StoreIndex(steps=np.array([0]), T=T, num_envs=1,
                     episode_id=np.array([[0], [0], [1]]), episode_seed=np.array([[10], [10], [11]]),
                     step_mask=mask[:, None, :], terminated=np.array([[False], [True], [False]]),
                     truncated=np.zeros((T, 1), bool), success=np.array([[False], [True], [False]]),
                     contiguous=np.array([False, True, True]))
    ep = find_episodes(idx)[0]
    data = EpisodeData(obs={p: obs[p] for p in range(T)}, actions={p: acts[p, :, :] for p in range(T)},
                       rewards={p: rewards[p] for p in range(T)})
    return ep, idx, data


def test_stored_episode_replays_exactly():
    ep, idx, data = _episode([1, 1, 1, 1, 0, 0])
    assert ep.positions == [0, 1] and ep.complete and ep.known_start
    row = replay_episode(SumEnv(), ep, idx, data, ignore_terminations=False)
    assert row["verified"] and row["length"] == 3 and row["success_once"]
    assert row["max_abs_obs_diff"] == 0.0 and row["max_abs_reward_diff"] == 0.0 and not row["flag_mismatches"]


def test_a_changed_action_is_a_mismatch():
    ep, idx, data = _episode([1, 1, 1, 1, 0, 0])
    data.actions[0] = np.array([[1.0], [0.5]], np.float32)  # the simulator now gets 0.5: obs and reward differ
    row = replay_episode(SumEnv(), ep, idx, data, ignore_terminations=False)
    assert not row["verified"]
    assert row["max_abs_reward_diff"] == 0.5 and row["max_abs_obs_diff"] == 0.5
