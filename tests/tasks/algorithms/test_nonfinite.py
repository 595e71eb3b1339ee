"""Non-finite inputs and degenerate statistics in the pure math: a NaN stays where the formula puts it (never
poisoning other samples), degenerate statistics give the documented finite values (tasks.algorithms docstrings)."""
from __future__ import annotations

import math

import pytest
import torch

from tasks.algorithms import critic_loss, gae, grpo_advantages, normalize_advantages, ppo_actor_loss

NAN = float("nan")


def _gae_inputs():
    T, B = 4, 3
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(T, B, generator=g)
    values = torch.randn(T + 1, B, generator=g)
    terminated = torch.zeros(T, B, dtype=torch.bool)
    terminated[1, 0] = True  # env 0: episode [0, 1], then a new one [2, 3]
    truncated = torch.zeros(T, B, dtype=torch.bool)
    return dict(rewards=rewards, values=values, terminated=terminated, truncated=truncated,
                final_values=torch.zeros(T, B), gamma=0.9, lam=0.95)


@pytest.mark.parametrize("where, undefined", [
    # (field, t, b) made NaN -> the samples (t, b) whose advantage depends on it, from the formula
    (("rewards", 3, 0), {(2, 0), (3, 0)}),  # second episode of env 0 only: the done at t=1 cuts the recursion
    (("rewards", 1, 0), {(0, 0), (1, 0)}),  # first episode only
    (("values", 2, 0), {(2, 0)}),  # V(s_2) starts episode 2: step 1 is terminal (bootstrap 0), step 3 reads V(s_4)
    (("values", 2, 1), {(0, 1), (1, 1), (2, 1)}),  # env 1 has no done: delta_1 reads V(s_2), delta_2 subtracts it
    (("values", 4, 2), {(0, 2), (1, 2), (2, 2), (3, 2)}),  # the bootstrap value reaches the whole env
])
def test_gae_nan_reaches_exactly_the_samples_that_depend_on_it(where, undefined):
    inp = _gae_inputs()
    clean_adv, clean_ret = gae(**inp)
    name, t, b = where
    inp[name] = inp[name].clone()
    inp[name][t, b] = NAN
    adv, ret = gae(**inp)
    bad = {(i, j) for i in range(4) for j in range(3) if not math.isfinite(float(adv[i, j]))}
    assert bad == undefined
    keep = torch.isfinite(adv)
    assert torch.equal(adv[keep], clean_adv[keep])  # the others are untouched, bit for bit
    if name == "rewards":
        assert torch.equal(torch.isfinite(ret), keep)


@pytest.mark.parametrize("adv, mask, expected", [
    ([1.0, 2.0, 3.0, 4.0], [0, 0, 0, 0], [0.0, 0.0, 0.0, 0.0]),  # empty mask
    ([1.0, 2.0, 3.0, 4.0], [0, 1, 0, 0], [0.0, 0.0, 0.0, 0.0]),  # one element: no spread
    ([0.3, 0.3, 0.3, 7.0], [1, 1, 1, 0], [0.0, 0.0, 0.0, 0.0]),  # all equal (float32 0.3: mean has a residue)
    ([NAN, 1.0, 3.0, math.inf], [0, 1, 1, 0], [0.0, -1.0, 1.0, 0.0]),  # non-finite OUTSIDE the mask never read
])
def test_normalize_advantages_degenerate_cases(adv, mask, expected):
    out = normalize_advantages(torch.tensor(adv), torch.tensor(mask, dtype=torch.bool))
    torch.testing.assert_close(out, torch.tensor(expected), atol=1e-6, rtol=0)


def test_normalize_advantages_tiny_std_is_centred_not_blown_up():
    adv = torch.tensor([1.0, 1.0 + 1e-7, 1.0 - 1e-7], dtype=torch.float64)
    out = normalize_advantages(adv, torch.ones(3, dtype=torch.bool), eps=1e-6)
    torch.testing.assert_close(out, adv - adv.mean(), atol=1e-15, rtol=0)


def test_normalize_advantages_refuses_nan_inside_the_mask():
    adv = torch.randn(4, 2)
    adv[2, 1] = NAN  # the example: one NaN in a [4, 2] rollout
    with pytest.raises(ValueError, match=r"advantages: 1 non-finite value\(s\) inside the mask, first at index \(2, 1\)"):
        normalize_advantages(adv, torch.ones(4, 2, dtype=torch.bool))
    keep = torch.isfinite(adv)  # masked: every other sample normalised over the finite ones
    out = normalize_advantages(adv, keep)
    ref = (adv[keep] - adv[keep].mean()) / (adv[keep].std(unbiased=False) + 1e-8)
    torch.testing.assert_close(out[keep], ref)
    assert out[2, 1] == 0 and torch.isfinite(out).all()


def _grpo(rewards, env_mask=None, g=4):
    T, B = rewards.shape
    z = torch.zeros(T, B, dtype=torch.bool)
    return grpo_advantages(rewards=rewards, terminated=z, truncated=z, step_mask=torch.ones(T, B, 1, dtype=torch.bool),
                           group_size=g, env_mask=env_mask)


def test_grpo_nan_reward_is_an_error_or_leaves_only_its_env():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0, 1.0, 1.0, 0.0, 3.0],
                            [0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 1.0, 0.0]])  # [T=2, B=8], groups of 4
    rewards[1, 3] = NAN
    with pytest.raises(ValueError, match=r"env b=3, chunk step t=1"):
        _grpo(rewards)
    env_mask = torch.ones(8, dtype=torch.bool)
    env_mask[3] = False
    res = _grpo(rewards, env_mask)
    assert torch.isfinite(res["advantages"]).all()
    assert not res["loss_mask"][:, 3].any() and (res["advantages"][:, 3] == 0).all()
    # group 0 without env 3 is the group of its three remaining members, by the formula
    scores = torch.tensor([1.0, 1.0, 2.0])
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    torch.testing.assert_close(res["advantages"][0, :3], expected)
    # group 1 is untouched
    torch.testing.assert_close(res["advantages"][:, 4:], _grpo(rewards[:, 4:].clone())["advantages"])


def test_grpo_group_with_one_member_left_gets_zero():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    env_mask = torch.tensor([False, True, False, False])
    res = _grpo(rewards, env_mask)
    assert (res["advantages"] == 0).all() and res["group_std"][0] == 0


def test_losses_never_leak_nan_from_masked_slots_into_value_or_gradient():
    N = 6
    lp = torch.zeros(N, requires_grad=True)
    v = torch.zeros(N, requires_grad=True)
    mask = torch.tensor([1, 1, 1, 0, 0, 0], dtype=torch.bool)
    bad = torch.tensor([0.0, 0.0, 0.0, NAN, math.inf, NAN])
    pl = ppo_actor_loss(logprobs=lp, old_logprobs=bad, advantages=bad + 1.0, loss_mask=mask,
                        clip_ratio_low=0.2, clip_ratio_high=0.2)
    vl = critic_loss(values=v, returns=bad + 2.0, old_values=bad, loss_mask=mask, value_clip=0.5)
    (pl["loss"] + vl["loss"]).backward()
    for t in (pl["loss"], vl["loss"], pl["approx_kl"], pl["clipfrac"], vl["explained_variance"]):
        assert torch.isfinite(t)
    assert torch.isfinite(lp.grad).all() and torch.isfinite(v.grad).all()
    assert (lp.grad[3:] == 0).all() and (v.grad[3:] == 0).all()


def test_empty_mask_gives_zero_losses_and_metrics():
    N = 4
    lp = torch.randn(N, requires_grad=True)
    none = torch.zeros(N, dtype=torch.bool)
    pl = ppo_actor_loss(logprobs=lp, old_logprobs=torch.randn(N), advantages=torch.randn(N), loss_mask=none,
                        clip_ratio_low=0.2, clip_ratio_high=0.2)
    vl = critic_loss(values=lp, returns=torch.randn(N), loss_mask=none, value_clip=None)
    for k in ("loss", "approx_kl", "clipfrac", "ratio_mean"):
        assert float(pl[k].detach()) == 0.0, k
    assert float(vl["loss"].detach()) == 0.0 and float(vl["explained_variance"]) == 0.0
