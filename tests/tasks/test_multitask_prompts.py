"""Per-env prompts: a shard whose envs are on different tasks prompts each env with its own task's
instruction, the trajectory stores the task_id, and the update rebuilds the same per-sample prompts from it.

A 2-task fake simulator (pure numpy, images) and pi0 tiny, untrained: its log-probs depend on the prompt,
so the log-probs the update recomputes equal the rollout's only when every sample gets its rollout prompt back.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.config import load_config
from tasks import prompts, resident, rollout
from tasks.actor import entries, loop
from tasks.envs.shard import EnvShard

RUN = "multitask-test"
TABLE = ("put the bowl on the plate", "open the top drawer of the cabinet")  # the instruction table: task 0, 1


class TwoTaskEnv:
    """Reset seed s -> task s % 2, trial s // 2; obs [t, task] (so nothing but the prompt tells the policy apart
    at t = 0 besides the state), images a constant per task; truncated after `limit` actions."""

    obs_dim, action_dim, image_shape = 8, 7, (16, 16, 3)

    def __init__(self, limit: int = 6):
        self.limit, self.t, self.task_id, self.trial_id = limit, 0, None, None

    def reset(self, seed: int) -> np.ndarray:
        self.task_id, self.trial_id, self.t = seed % 2, seed // 2, 0
        return self._obs()

    def _obs(self) -> np.ndarray:
        return np.full(8, 0.1 * self.t, np.float32)

    def step(self, action):
        self.t += 1
        return self._obs(), 0.0, False, self.t >= self.limit, False

    def render_rgb(self) -> np.ndarray:
        return np.full(self.image_shape, 100, np.uint8)

    def close(self) -> None:
        pass


@pytest.fixture
def fake_sim(monkeypatch):
    def make_shard(e, *, shard, num_shards, num_envs, auto_reset, ignore_terminations, base_seed,
                   episode_count=None, seed_fn=None, group_size=1):
        size = num_envs // num_shards
        return EnvShard([TwoTaskEnv() for _ in range(size)], env_offset=shard * size, num_envs_total=num_envs,
                        base_seed=base_seed, auto_reset=auto_reset, ignore_terminations=ignore_terminations,
                        episode_count=episode_count, seed_fn=seed_fn, group_size=group_size)
    monkeypatch.setattr(rollout, "make_shard", make_shard)
    monkeypatch.setattr(rollout, "instructions", lambda cfg: TABLE)
    monkeypatch.setattr(loop, "instructions", lambda cfg: TABLE)
    resident.release("")
    yield
    resident.release("")


def test_update_recomputes_the_rollouts_logprobs_with_per_env_prompts(fake_sim):
    torch.manual_seed(0)
    cfg = load_config(["conf=pushcube_pi0_grpo", "policy.model_path=null", "env.num_envs=4", "env.num_shards=1",
                       "env.image_size=16", "algorithm.group_size=2", "rollout.chunk_steps=2",
                       "rollout.chunk_steps_per_node=2"], components=False)[0]
    weights = entries.actor_init(cfg, RUN, (8, 7))
    seg = rollout.env_step(cfg, RUN, 0, weights, 2, None, True, None, True)
    traj = rollout.trajectory(seg)
    # groups of 2 share seeds 0 and 1: envs 0, 1 on task 0, envs 2, 3 on task 1, at both chunk steps
    assert traj["task_id"].tolist() == [[0, 0, 1, 1]] * 2 and traj["task_id"].dtype == np.int64
    assert traj["trial_id"].tolist() == [[0, 0, 0, 0]] * 2
    data = loop.flatten([{k: traj[k] for k in traj if k in loop.SAMPLE_FIELDS or k.startswith("extras/")}])
    policy = resident.get(f"{RUN}/policy").module
    idx = torch.arange(len(data["obs"]))

    def recomputed(prompts_data):
        with torch.no_grad():
            obs = loop.batch_obs(policy, prompts_data, idx, TABLE)
            return policy.evaluate(obs, data["actions"], loop.batch_extras(data, idx))["logprobs"]

    torch.testing.assert_close(recomputed(data), data["logprobs"], rtol=0, atol=1e-5)
    # the prompts matter: the same samples all prompted with task 0's instruction give other log-probs
    wrong = {**data, "task_id": torch.zeros_like(data["task_id"])}
    assert (recomputed(wrong) - data["logprobs"]).abs().max() > 1e-3
    # and the batch's prompt rows are the table's rows at each sample's task
    tok = prompts.prompt_tokens(policy, TABLE, data["task_id"])
    for i, t in enumerate(data["task_id"].tolist()):
        assert torch.equal(tok[i], policy.tokenize([TABLE[t]])[0])


def test_prompt_tokens_refuses_a_task_outside_the_table():
    from tasks.policies import make_policy
    cfg = load_config(["conf=pushcube_pi0_grpo", "policy.model_path=null", "env.image_size=16"],
                      components=False)[0]
    pol = make_policy(cfg.policy, obs_dim=8, action_dim=7, num_values=1, image_size=16, load=False)
    with pytest.raises(IndexError, match="outside the instruction table of 2"):
        prompts.prompt_tokens(pol, TABLE, np.array([0, 2]))
    assert prompts.prompt_tokens(pol, "one task", None, 3).shape[0] == 3  # a single string: every sample
