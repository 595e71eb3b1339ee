"""algorithm.actor_loss=filtered_bc: behaviour cloning on the rollout's own chunk steps with advantage > 0 (CRR's
binary filter). The loss against a hand-computed NLL, the masked `sft_loss` of every policy family, the update end to
end on the CPU MLP, the config's refusals, and a learning check on the flow VLA (ODE actions, no log-probs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks import resident
from tasks.config import Config, ConfigError, family_class, replace_key, replace_keys
from tasks.actor.entries import actor_init, actor_update, advantages
from tasks.actor.loop import flatten, minibatch_loss, prepare_update

T, B, C, D, O = 3, 4, 2, 2, 3  # 4 envs in 2 GRPO groups of 2, chunks of 2 actions


def _cfg(**algo) -> Config:
    return replace_keys(Config(), {
        "rollout.chunk_steps": T, "env.num_envs": B, "env.num_shards": 1,
        "policy.hidden_sizes": [8, 8], "policy.num_action_chunks": C,
        "algorithm.name": "grpo", "algorithm.group_size": 2, "algorithm.actor_loss": "filtered_bc",
        "algorithm.update_epochs": 4, "algorithm.num_minibatches": 1, "algorithm.target_kl": None,
        "algorithm.lr": 1e-2, **{f"algorithm.{k}": v for k, v in algo.items()}})


def _traj() -> dict:
    """Env scores (summed rewards): group 0 = envs 0, 1 with 3 vs 1; group 1 = envs 2, 3 with 0 vs 2. The last
    action of env 0's last chunk was not executed."""
    r = np.random.default_rng(0)
    f = np.float32
    rewards = np.zeros((T, B, C), f)
    rewards[0, :, 0] = [3.0, 1.0, 0.0, 2.0]
    step_mask = np.ones((T, B, C), bool)
    step_mask[T - 1, 0, 1] = False
    return {"obs": r.standard_normal((T, B, O)).astype(f), "actions": r.standard_normal((T, B, C, D)).astype(f),
            "logprobs": np.zeros((T, B, C, D), f), "values": np.zeros((T, B, 1), f),
            "final_values": np.zeros((T, B, 1), f), "rewards": rewards, "terminated": np.zeros((T, B), bool),
            "truncated": np.zeros((T, B), bool), "step_mask": step_mask,
            "bootstrap_values": np.zeros((B, 1), f), "weight_version": 0}


@pytest.fixture
def run_id():
    yield "fbc"
    resident.release("fbc/")


def test_loss_is_the_nll_of_the_executed_actions_of_the_above_group_mean_envs(run_id):
    cfg = _cfg()
    data = flatten([advantages(cfg, _traj())])  # [T*B] samples, sample i = (t, b) = divmod(i, B)
    prep = prepare_update(cfg, data)
    kept_envs = {0, 3}  # 3 > 2 (group 0) and 2 > 1 (group 1)
    env = torch.arange(T * B) % B
    expect_mask = torch.tensor([[b in kept_envs] * C for b in env.tolist()])
    expect_mask[(T - 1) * B + 0, 1] = False  # not executed
    assert torch.equal(prep["bc_mask"], expect_mask)
    w = actor_init(cfg, run_id, (O, D))
    policy = resident.get(f"{run_id}/actor").policy
    idx = torch.arange(T * B)
    terms = minibatch_loss(cfg, policy, data, prep, idx, None)
    # by hand: per kept sample the NLL summed over its executed actions' dims, then the mean over kept samples
    with torch.no_grad():
        mean = policy.actor_mean(data["obs"]).view(-1, C, D)  # [N, C, D]
        std = policy.actor_logstd.exp().view(C, D)
        total, n = 0.0, 0
        for i in range(T * B):
            if not expect_mask[i].any():
                continue
            nll = 0.0
            for c in range(C):
                for d in range(D):
                    if expect_mask[i, c]:
                        z = (float(data["actions"][i, c, d]) - float(mean[i, c, d])) / float(std[c, d])
                        nll += 0.5 * z * z + float(torch.log(std[c, d])) + 0.5 * np.log(2 * np.pi)
            total, n = total + nll, n + 1
    assert n == 2 * T
    assert float(terms["actor_loss"].detach()) == pytest.approx(total / n, rel=1e-5)
    assert float(terms["approx_kl"]) == 0 and float(terms["clipfrac"]) == 0
    assert w["version"] == 0


def test_update_raises_the_likelihood_of_the_kept_actions_only(run_id):
    cfg = _cfg()
    samples = [advantages(cfg, _traj())]
    data = flatten(samples)
    prep = prepare_update(cfg, data)
    w = actor_init(cfg, run_id, (O, D))
    policy = resident.get(f"{run_id}/actor").policy
    idx = torch.arange(T * B)
    drop = {**prep, "bc_mask": prep["step_mask"] & ~prep["bc_mask"]}  # the envs below their group's mean

    def nlls() -> tuple[float, float]:
        with torch.no_grad():
            return (float(minibatch_loss(cfg, policy, data, prep, idx, None)["actor_loss"]),
                    float(minibatch_loss(cfg, policy, data, drop, idx, None)["actor_loss"]))

    kept0, dropped0 = nlls()
    out = actor_update(cfg, run_id, w, *samples)
    kept1, dropped1 = nlls()
    m = out["metrics"]
    assert kept1 < kept0 - 0.1  # 4 Adam steps at lr 1e-2 on 6 samples
    assert m["train/bc_kept_fraction"] == pytest.approx((2 * T * C - 1) / (T * B * C - 1))
    assert m["train/minibatch_updates"] == 4 and m["train/actor_loss"] == pytest.approx(
        m["train/loss"])  # no critic in GRPO: loss = BC loss
    assert out["version"] == 1
    assert np.isfinite([dropped0, dropped1]).all()
    # "only": the update does not read the dropped envs' actions (nor env 0's unexecuted last action) at all;
    # replacing them with anything gives the same weights
    resident.release(f"{run_id}/")
    w = actor_init(cfg, run_id, (O, D))
    traj = _traj()
    traj["actions"][:, [1, 2]] = 1e3 * np.random.default_rng(5).standard_normal((T, 2, C, D))
    traj["actions"][T - 1, 0, 1] = -1e3
    other = actor_update(cfg, run_id, w, advantages(cfg, traj))
    for k, v in out["state_dict"].items():
        assert torch.equal(other["state_dict"][k], v), k


@pytest.mark.parametrize("family", ["token_vla"])  # pi0 / pi05: tests/tasks/policies/test_pi0.py
def test_masked_sft_loss_ignores_masked_actions_and_equals_the_plain_loss_when_all_set(family):
    torch.manual_seed(0)
    cfg = family_class("policy", family)(num_action_chunks=2, max_prompt_len=8)
    from tasks.policies import make_policy
    pol = make_policy(cfg, obs_dim=3, action_dim=2, num_values=1)
    N = 6
    obs = {"state": torch.randn(N, 3), "prompt": pol.tokenize(["push"] * N)}
    acts = torch.rand(N, 2, 2) * 2 - 1
    mask = torch.ones(N, 2, dtype=torch.bool)

    def loss(a, m):
        torch.manual_seed(7)  # the flow loss draws noise and times: the same draws in each call
        with torch.no_grad():
            return float(pol.sft_loss(obs, a, m))

    assert loss(acts, mask) == pytest.approx(loss(acts, None), rel=1e-6)
    mask[1] = False
    wild = acts.clone()
    wild[1] = 0.99 if family == "token_vla" else 1e4  # a masked sample may hold anything
    if family == "token_vla":  # its tokens are predicted from the observation alone: one masked action is ignored
        mask[4, 0] = False  # too (the flow's chunk attends over all its actions: the executed ones see the rest)
        wild[4, 0] = -0.99
    assert loss(wild, mask) == pytest.approx(loss(acts, mask), rel=1e-6)
    assert loss(wild, None) != pytest.approx(loss(acts, None), rel=1e-3)


def test_config_refuses_unknown_actor_loss_and_deterministic_rollouts_under_ppo():
    from tasks.config.checks import check_across, check_algorithm
    cfg = replace_key(Config(), "algorithm.actor_loss", "awr")
    with pytest.raises(ConfigError, match="algorithm.actor_loss"):
        check_algorithm(cfg.algorithm)
    cfg = replace_key(Config(), "rollout.deterministic", True)
    with pytest.raises(ConfigError, match=r"rollout.deterministic.*actor_loss=filtered_bc"):
        check_across(cfg)
    cfg = replace_key(cfg, "algorithm.actor_loss", "filtered_bc")
    check_algorithm(cfg.algorithm)
    check_across(cfg)


def test_with_a_critic_the_loss_adds_the_value_loss_as_ppo_does(run_id):
    """GAE advantages (a critic): the filter keeps advantage > 0 after the batch normalisation, and the loss is
    BC + value_coef * the critic loss that ppo's minibatch_loss computes on the same samples."""
    cfg = _cfg(name="ppo", group_size=1)
    data = flatten([advantages(cfg, _traj())])
    prep = prepare_update(cfg, data)
    assert torch.equal(prep["bc_mask"], prep["step_mask"] & (prep["adv"].reshape(T * B, -1)[:, :1] > 0))
    actor_init(cfg, run_id, (O, D))
    policy = resident.get(f"{run_id}/actor").policy
    idx = torch.arange(T * B)
    with torch.no_grad():
        fbc = minibatch_loss(cfg, policy, data, prep, idx, None)
        cfg = replace_key(cfg, "algorithm.actor_loss", "ppo")
        ppo = minibatch_loss(cfg, policy, data, prepare_update(cfg, data), idx, None)
    assert float(fbc["critic_loss"]) == pytest.approx(float(ppo["critic_loss"]), rel=1e-6) and float(fbc["critic_loss"]) > 0
    assert float(fbc["loss"]) == pytest.approx(float(fbc["actor_loss"]) + cfg.algorithm.value_coef
                                               * float(fbc["critic_loss"]), rel=1e-6)
