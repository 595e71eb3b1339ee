"""The flow VLA learns from rewards alone: a one-step bandit (reward = -||a - target||^2) trained with the real
PPO pieces (stored denoising chain -> `evaluate` -> token-level `ppo_actor_loss`), for both piRL samplers.
The deterministic (ODE) action must move most of the way to the target: a learning check with a threshold."""
from __future__ import annotations

import pytest
import torch

from tasks.algorithms import normalize_advantages, ppo_actor_loss
from tasks.config import PolicyConfig
from tasks.policies.flow_vla import FlowVLAPolicy


@pytest.mark.parametrize("noise_method", ["flow_noise", "flow_sde"])
def test_ppo_moves_the_flow_policy_toward_the_rewarded_action(noise_method):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = PolicyConfig(name="flow_vla", num_action_chunks=1, num_denoise_steps=4, noise_method=noise_method,
                       noise_level=0.5, max_prompt_len=8)
    pol = FlowVLAPolicy(cfg, obs_dim=3, action_dim=2, num_values=1, image_size=None)
    B = 64
    obs = {"state": torch.zeros(B, 3), "prompt": pol.tokenize(["reach"] * B)}
    target = torch.tensor([0.6, -0.4])

    def distance() -> float:
        with torch.no_grad():
            torch.manual_seed(123)
            a = pol.act(obs, deterministic=True)["actions"][:, 0]
        return float((a - target).norm(dim=-1).mean())

    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    start = distance()
    for _ in range(40):
        with torch.no_grad():
            out = pol.act(obs)
        reward = -((out["actions"][:, 0] - target) ** 2).sum(-1)  # [B]
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
