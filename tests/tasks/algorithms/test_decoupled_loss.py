"""Decoupled PPO (tasks.algorithms.decoupled_ppo_actor_loss): equals PPO when proximal == behaviour, weights the
clipped surrogate by proximal / behaviour otherwise, and its cap."""
import math

import pytest
import torch

from tasks.algorithms import decoupled_ppo_actor_loss, ppo_actor_loss


def _inputs(shape=(5, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(shape, generator=g, dtype=torch.float64)
    new = (old + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) > 0.2
    return new, old, adv, mask


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
def test_proximal_equal_to_behaviour_is_ppo_exactly(dual_clip, reduction):
    new, old, adv, mask = _inputs()
    kw = dict(advantages=adv, loss_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=dual_clip,
              reduction=reduction)
    ppo = ppo_actor_loss(logprobs=new, old_logprobs=old, **kw)
    dec = decoupled_ppo_actor_loss(logprobs=new, proximal_logprobs=old, behaviour_logprobs=old.clone(), **kw)
    for k in ppo:
        assert torch.equal(ppo[k], dec[k]), k
    g1, = torch.autograd.grad(ppo["loss"], new)
    g2, = torch.autograd.grad(dec["loss"], new)
    assert torch.equal(g1, g2)
    assert dec["behaviour_weight_mean"].item() == 1.0 and dec["behaviour_capfrac"].item() == 0.0


def test_stale_samples_are_weighted_by_proximal_over_behaviour_and_clipped_around_proximal():
    # one element: behaviour lp 0, proximal lp log 2 (w = 2), new lp = proximal + log 1.5 (ratio 1.5 vs proximal)
    beh = torch.zeros(1, dtype=torch.float64)
    prox = torch.full((1,), math.log(2.0), dtype=torch.float64)
    new = (prox + math.log(1.5)).clone().requires_grad_(True)
    out = decoupled_ppo_actor_loss(logprobs=new, proximal_logprobs=prox, behaviour_logprobs=beh,
                                   advantages=torch.ones(1, dtype=torch.float64), loss_mask=torch.ones(1, dtype=torch.bool),
                                   clip_ratio_low=0.2, clip_ratio_high=0.2)
    # max(-1 * 1.5, -1 * 1.2) = -1.2, times w = 2
    assert out["loss"].item() == pytest.approx(-2.4)
    assert out["clipfrac"].item() == 1.0 and out["ratio_mean"].item() == pytest.approx(1.5)
    assert out["behaviour_weight_mean"].item() == pytest.approx(2.0)
    # plain PPO against the behaviour log-probs would see ratio 3 and clip it to 1.2 without the weight
    ppo = ppo_actor_loss(logprobs=new, old_logprobs=beh, advantages=torch.ones(1, dtype=torch.float64),
                         loss_mask=torch.ones(1, dtype=torch.bool), clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert ppo["loss"].item() == pytest.approx(-1.2)


def test_behaviour_weight_cap_zeroes_the_capped_elements():
    beh = torch.zeros(4, dtype=torch.float64)
    prox = torch.log(torch.tensor([1.0, 2.0, 4.0, 8.0], dtype=torch.float64))
    new = prox.clone().requires_grad_(True)
    adv = -torch.ones(4, dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    out = decoupled_ppo_actor_loss(logprobs=new, proximal_logprobs=prox, behaviour_logprobs=beh, advantages=adv,
                                   loss_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, behaviour_weight_cap=3.0)
    # ratio 1 everywhere: pg = 1 * w; weights [1, 2, 0, 0] (4 and 8 exceed the cap), mean over all 4 elements
    assert out["loss"].item() == pytest.approx(3.0 / 4)
    assert out["behaviour_capfrac"].item() == 0.5
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        decoupled_ppo_actor_loss(logprobs=new, proximal_logprobs=prox, behaviour_logprobs=beh, advantages=adv,
                                 loss_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2, behaviour_weight_cap=1.0)


def test_shape_mismatch_raises():
    new, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="shape mismatch"):
        decoupled_ppo_actor_loss(logprobs=new, proximal_logprobs=old, behaviour_logprobs=old[:, :2], advantages=adv,
                                 loss_mask=mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
