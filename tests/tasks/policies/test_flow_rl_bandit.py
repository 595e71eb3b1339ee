"""The flow VLA learns from rewards alone: a one-step bandit (reward = -||a - target||^2) trained with the real
pieces — PPO (stored denoising chain -> `evaluate` -> token-level `ppo_actor_loss`) for both piRL samplers, and
filtered behaviour cloning (`sft_loss` with a mask on the above-group-mean ODE actions: algorithm.actor_loss=
filtered_bc). The deterministic (ODE) action must move most of the way to the target: a learning check with a
threshold."""
from __future__ import annotations

import pytest
import torch

from tasks.algorithms import normalize_advantages, ppo_actor_loss
from tasks.policies.flow_vla.configuration import FlowVLAConfig
from tasks.policies.flow_vla.model import FlowVLAPolicy

B = 64
TARGET = torch.tensor([0.6, -0.4])


def _bandit(noise_method: str = "flow_noise"):
    """(policy, obs [B], distance()): distance = mean ||ODE action - target|| at a fixed initial noise."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = FlowVLAConfig(name="flow_vla", num_action_chunks=1, num_denoise_steps=4, noise_method=noise_method,
                       noise_level=0.5, max_prompt_len=8)
    pol = FlowVLAPolicy(cfg, obs_dim=3, action_dim=2, num_values=1, image_size=None)
    obs = {"state": torch.zeros(B, 3), "prompt": pol.tokenize(["reach"] * B)}

    def distance() -> float:
        with torch.no_grad():
            torch.manual_seed(123)
            a = pol.act(obs, deterministic=True)["actions"][:, 0]
        return float((a - TARGET).norm(dim=-1).mean())

    return pol, obs, distance


@pytest.mark.parametrize("noise_method", ["flow_noise", "flow_sde"])
def test_ppo_moves_the_flow_policy_toward_the_rewarded_action(noise_method):
    pol, obs, distance = _bandit(noise_method)
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    start = distance()
    for _ in range(40):
        with torch.no_grad():
            out = pol.act(obs)
        reward = -((out["actions"][:, 0] - TARGET) ** 2).sum(-1)  # [B]
        adv = normalize_advantages(reward, torch.ones(B, dtype=torch.bool))
        for _ in range(2):
            ev = pol.evaluate(obs, out["actions"], out["extras"])
            loss = ppo_actor_loss(logprobs=ev["logprobs"], old_logprobs=out["logprobs"],
                                  advantages=adv[:, None, None].expand_as(ev["logprobs"]),
                                  loss_mask=torch.ones_like(ev["logprobs"], dtype=torch.bool),
                                  clip_ratio_low=0.2, clip_ratio_high=0.2)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
    end = distance()
    assert end < 0.5 * start, (start, end)


def test_filtered_bc_moves_the_flow_policy_toward_the_rewarded_action_from_ode_samples():
    """ODE actions (random initial noise, no log-probs) in 8 groups of 8 sharing one observation: imitating each
    group's above-mean half (GRPO's advantage > 0) must move the ODE's actions toward the target."""
    pol, obs, distance = _bandit()
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    start = distance()
    for _ in range(30):
        with torch.no_grad():
            acts = pol.act(obs, deterministic=True)["actions"]  # [B, 1, 2]
        score = -((acts[:, 0] - TARGET) ** 2).sum(-1).reshape(8, 8)
        keep = (score > score.mean(1, keepdim=True)).reshape(B, 1)
        for _ in range(8):
            loss = pol.sft_loss(obs, acts, keep)
            opt.zero_grad()
            loss.backward()
            opt.step()
    end = distance()
    assert end < 0.5 * start, (start, end)
