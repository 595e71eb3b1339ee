"""Flow-matching policies learn from rewards alone: a one-step bandit (reward = -||a - target||^2) trained with the
real sampling pieces of every flow family (`tasks.policies.flow_sampling`: `sample_chain` at act time,
`chain_logprobs` at update time) and the real token-level `ppo_actor_loss`, for both piRL samplers, and filtered
behaviour cloning (the flow-matching loss with a mask on the above-group-mean ODE actions: algorithm.actor_loss=
filtered_bc). The velocity field is a minimal MLP (the pi0 / pi05 families put transformers' networks behind the
same functions; a pi0-tiny bandit took longer and needed other learning rates). The deterministic (ODE) action must
move most of the way to the target: a learning check with a threshold."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tasks.algorithms import normalize_advantages, ppo_actor_loss
from tasks.policies.flow_sampling import NoiseStdHead, chain_logprobs, sample_chain

B, K, A, W = 64, 4, 2, 64
TARGET = torch.tensor([0.6, -0.4])


class TinyFlow(nn.Module):
    """A velocity field v(x [N, 1, A], t [N]) -> ([N, 1, A], features [N, 1, W]) with the families' act / evaluate /
    sft_loss on top of flow_sampling (one chunk of one action, one constant observation)."""

    def __init__(self, noise_method: str):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(A + 1, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh())
        self.out = nn.Linear(W, A)
        self.noise_head = NoiseStdHead(W, A, 0.08, 0.16) if noise_method == "flow_noise" else None

    def velocity(self, x, t):
        feats = self.trunk(torch.cat([x, t[:, None, None].expand(-1, x.shape[1], 1)], dim=-1))
        return self.out(feats), feats

    def act(self, deterministic=False):
        x0, chain, logp, idx = sample_chain(self.velocity, torch.randn(B, 1, A), num_steps=K, noise_level=0.5,
                                            noise_head=self.noise_head, deterministic=deterministic)
        return {"actions": x0, "logprobs": logp, "extras": {"chain": chain, "denoise_idx": idx}}

    def evaluate(self, extras):
        return chain_logprobs(self.velocity, extras["chain"], extras["denoise_idx"], num_steps=K, noise_level=0.5,
                              noise_head=self.noise_head)[0]

    def sft_loss(self, actions, mask):
        """The flow-matching loss (pi0's convention: x_t = t noise + (1 - t) a, v = noise - a) over mask [N, 1]."""
        noise, t = torch.randn_like(actions), torch.rand(actions.shape[0])
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        err = ((self.velocity(x_t, t)[0] - (noise - actions)) ** 2).mean(-1)  # [N, 1]
        return (err * mask).sum() / mask.sum().clamp(min=1)


def _bandit(noise_method: str = "flow_noise"):
    """(policy, distance()): distance = mean ||ODE action - target|| at a fixed initial noise."""
    torch.manual_seed(0)
    pol = TinyFlow(noise_method)

    def distance() -> float:
        with torch.no_grad():
            torch.manual_seed(123)
            a = pol.act(deterministic=True)["actions"][:, 0]
        return float((a - TARGET).norm(dim=-1).mean())

    return pol, distance


@pytest.mark.parametrize("noise_method", ["flow_noise", "flow_sde"])
def test_ppo_moves_the_flow_policy_toward_the_rewarded_action(noise_method):
    pol, distance = _bandit(noise_method)
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    start = distance()
    for _ in range(40):
        with torch.no_grad():
            out = pol.act()
        reward = -((out["actions"][:, 0] - TARGET) ** 2).sum(-1)  # [B]
        adv = normalize_advantages(reward, torch.ones(B, dtype=torch.bool))
        for _ in range(2):
            logprobs = pol.evaluate(out["extras"])
            loss = ppo_actor_loss(logprobs=logprobs, old_logprobs=out["logprobs"],
                                  advantages=adv[:, None, None].expand_as(logprobs),
                                  loss_mask=torch.ones_like(logprobs, dtype=torch.bool),
                                  clip_ratio_low=0.2, clip_ratio_high=0.2)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
    end = distance()
    assert end < 0.5 * start, (start, end)


def test_filtered_bc_moves_the_flow_policy_toward_the_rewarded_action_from_ode_samples():
    """ODE actions (random initial noise, no log-probs) in 8 groups of 8: imitating each group's above-mean half
    (GRPO's advantage > 0) must move the ODE's actions toward the target."""
    pol, distance = _bandit()
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    start = distance()
    for _ in range(30):
        with torch.no_grad():
            acts = pol.act(deterministic=True)["actions"]  # [B, 1, 2]
        score = -((acts[:, 0] - TARGET) ** 2).sum(-1).reshape(8, 8)
        keep = (score > score.mean(1, keepdim=True)).reshape(B, 1)
        for _ in range(8):
            loss = pol.sft_loss(acts, keep)
            opt.zero_grad()
            loss.backward()
            opt.step()
    end = distance()
    assert end < 0.5 * start, (start, end)
