"""Tests for tasks.algorithms.losses: masked reductions, PPO actor/critic losses, normalisation."""

import math

import pytest
import torch

from tasks.algorithms.losses import (
    aggregate_loss,
    critic_loss,
    entropy_bonus,
    masked_mean,
    normalize_advantages,
    ppo_actor_loss,
)

RATIOS = [0.5, 1.0, 1.5, 0.5, 1.0, 1.5]
ADVS = [2.0, 2.0, 2.0, -1.0, -1.0, -1.0]


def _hand_inputs(mask=None):
    logprobs = torch.tensor([math.log(r) for r in RATIOS], dtype=torch.float64, requires_grad=True)
    return dict(
        logprobs=logprobs,
        old_logprobs=torch.zeros(6, dtype=torch.float64),
        advantages=torch.tensor(ADVS, dtype=torch.float64),
        loss_mask=torch.ones(6, dtype=torch.bool) if mask is None else mask,
        clip_ratio_low=0.2,
        clip_ratio_high=0.3,
    )


def test_ppo_actor_loss_hand_computed():
    # clamp range [1 - 0.2, 1 + 0.3] = [0.8, 1.3]; per element max(-A*r, -A*clamp(r)):
    # r=0.5, A=+2: max(-1.0, -1.6) = -1.0  (unclipped)
    # r=1.0, A=+2: max(-2.0, -2.0) = -2.0
    # r=1.5, A=+2: max(-3.0, -2.6) = -2.6  (clipped)
    # r=0.5, A=-1: max( 0.5,  0.8) =  0.8  (clipped)
    # r=1.0, A=-1: max( 1.0,  1.0) =  1.0
    # r=1.5, A=-1: max( 1.5,  1.3) =  1.5  (unclipped)
    # loss = (-1 - 2 - 2.6 + 0.8 + 1 + 1.5) / 6 = -2.3 / 6 ; clipfrac = 2/6 ; ratio_mean = 1.0
    # approx_kl (k3) = mean((r-1) - ln r) = 2*[(-0.5 + ln 2) + 0 + (0.5 - ln 1.5)] / 6
    out = ppo_actor_loss(**_hand_inputs())
    assert out["loss"].item() == pytest.approx(-2.3 / 6)
    assert out["clipfrac"].item() == pytest.approx(2 / 6)
    assert out["ratio_mean"].item() == pytest.approx(1.0)
    k3 = 2 * ((-0.5 + math.log(2)) + (0.5 - math.log(1.5))) / 6
    assert out["approx_kl"].item() == pytest.approx(k3)
    assert out["dual_clipfrac"].item() == 0.0
    assert not out["clipfrac"].requires_grad and out["loss"].requires_grad


def test_ppo_actor_loss_hand_masked():
    # drop the last element (1.5): loss = (-1 - 2 - 2.6 + 0.8 + 1) / 5 = -3.8 / 5 ; clipfrac = 2/5
    mask = torch.tensor([True, True, True, True, True, False])
    out = ppo_actor_loss(**_hand_inputs(mask))
    assert out["loss"].item() == pytest.approx(-0.76)
    assert out["clipfrac"].item() == pytest.approx(0.4)


def test_ppo_actor_gradient_is_zero_where_clipped():
    inputs = _hand_inputs()
    ppo_actor_loss(**inputs)["loss"].backward()
    # d/dlogp (-A * r / 6) = -A * r / 6 where unclipped; 0 where the clipped branch is active
    expected = [-2 * 0.5 / 6, -2 * 1.0 / 6, 0.0, 0.0, 1.0 / 6, 1.5 / 6]
    torch.testing.assert_close(inputs["logprobs"].grad, torch.tensor(expected, dtype=torch.float64))


def test_ppo_dual_clip_bounds_negative_advantage():
    # r = 4, A = -1: standard PPO gives max(4, 1.3) = 4 ; dual clip 3 bounds it to min(4, 3*1) = 3
    logprobs = torch.tensor([math.log(4.0), math.log(4.0)], requires_grad=True)
    kwargs = dict(
        logprobs=logprobs, old_logprobs=torch.zeros(2), advantages=torch.tensor([-1.0, 1.0]),
        loss_mask=torch.tensor([True, True]), clip_ratio_low=0.2, clip_ratio_high=0.3,
    )
    # A = +1 at r = 4: max(-4, -1.3) = -1.3 (dual clip never touches A > 0)
    plain = ppo_actor_loss(**kwargs)
    assert plain["loss"].item() == pytest.approx((4.0 - 1.3) / 2)
    dual = ppo_actor_loss(**kwargs, dual_clip=3.0)
    assert dual["loss"].item() == pytest.approx((3.0 - 1.3) / 2)
    assert dual["dual_clipfrac"].item() == pytest.approx(0.5)
    dual["loss"].backward()
    torch.testing.assert_close(logprobs.grad, torch.zeros(2))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_actor_loss(**kwargs, dual_clip=0.9)


def _loop_actor_loss(lp, old, adv, mask, low, high, dual, reduction):
    N, C = len(lp), len(lp[0])
    per = [[0.0] * C for _ in range(N)]
    for i in range(N):
        for j in range(C):
            r = math.exp(lp[i][j] - old[i][j])
            a = adv[i][j]
            v = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if dual is not None and a < 0:
                v = min(v, -a * dual)
            per[i][j] = v
    if reduction == "token-mean":
        num = sum(per[i][j] for i in range(N) for j in range(C) if mask[i][j])
        return num / sum(mask[i][j] for i in range(N) for j in range(C))
    rows = []
    for i in range(N):
        cnt = sum(mask[i])
        if cnt:
            rows.append(sum(per[i][j] for j in range(C) if mask[i][j]) / cnt)
    return sum(rows) / len(rows)


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean"])
@pytest.mark.parametrize("dual", [None, 2.5])
def test_ppo_actor_loss_matches_plain_loop(reduction, dual):
    g = torch.Generator().manual_seed(0)
    N, C = 7, 3
    lp = torch.randn(N, C, generator=g, dtype=torch.float64) * 0.5
    old = torch.randn(N, C, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(N, C, generator=g, dtype=torch.float64)
    mask = torch.rand(N, C, generator=g) < 0.7
    mask[2] = False  # an empty row: excluded from seq-mean
    mask[0] = True
    out = ppo_actor_loss(
        logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask,
        clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip=dual, reduction=reduction,
    )
    ref = _loop_actor_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, dual, reduction)
    assert out["loss"].item() == pytest.approx(ref, rel=1e-12)


def test_ppo_masked_garbage_gives_finite_loss_and_grads():
    lp = torch.tensor([0.0, 1e4], requires_grad=True)  # masked slot holds garbage
    out = ppo_actor_loss(
        logprobs=lp, old_logprobs=torch.zeros(2), advantages=torch.ones(2),
        loss_mask=torch.tensor([True, False]), clip_ratio_low=0.2, clip_ratio_high=0.2,
    )
    out["loss"].backward()
    assert out["loss"].item() == -1.0
    assert torch.isfinite(lp.grad).all() and lp.grad[1] == 0.0


def test_ppo_actor_loss_rejects_shape_mismatch_and_bad_reduction():
    kwargs = _hand_inputs()
    kwargs["advantages"] = kwargs["advantages"][:1]  # [1] would broadcast silently
    with pytest.raises(ValueError, match="shape"):
        ppo_actor_loss(**kwargs)
    with pytest.raises(ValueError, match="token-mean"):
        ppo_actor_loss(**_hand_inputs(), reduction="sum")


def test_critic_loss_clipping_hand_case():
    # c = 0.5 ; old = 1 everywhere
    # e0: v=1, R=2: unclipped (1-2)^2 = 1 ; clipped v' = 1 -> 1      ; 0.5*max = 0.5
    # e1: v=3, R=0: unclipped 9           ; clipped v' = 1.5 -> 2.25 ; 0.5*max = 4.5
    # e2: v=0, R=0: unclipped 0           ; clipped v' = 0.5 -> 0.25 ; 0.5*max = 0.125 (clipped)
    # loss = (0.5 + 4.5 + 0.125) / 3 ; clipfrac = 1/3
    # explained variance: Var[R] = 8/9, Var[R - v] = Var[1, -3, 0] = 26/9 -> 1 - 26/8 = -2.25
    values = torch.tensor([1.0, 3.0, 0.0], requires_grad=True)
    kwargs = dict(
        values=values, old_values=torch.ones(3), returns=torch.tensor([2.0, 0.0, 0.0]),
        loss_mask=torch.ones(3, dtype=torch.bool),
    )
    out = critic_loss(**kwargs, value_clip=0.5)
    assert out["loss"].item() == pytest.approx(5.125 / 3)
    assert out["clipfrac"].item() == pytest.approx(1 / 3)
    assert out["explained_variance"].item() == pytest.approx(-2.25)
    out["loss"].backward()
    assert values.grad[2].item() == 0.0  # clipped branch: no gradient
    assert values.grad[1].item() == pytest.approx(1.0)  # 0.5 * 2 * (3 - 0) / 3
    unclipped = critic_loss(**kwargs, value_clip=None)
    assert unclipped["loss"].item() == pytest.approx(5.0 / 3)  # 0.5 * (1 + 9 + 0) / 3
    assert unclipped["clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match="old_values"):
        critic_loss(values=values, returns=kwargs["returns"], loss_mask=kwargs["loss_mask"], value_clip=0.2)
    with pytest.raises(ValueError, match="shape"):
        critic_loss(values=values, returns=torch.zeros(3, 1), loss_mask=kwargs["loss_mask"], value_clip=None)


def test_masked_mean_values_and_empty_mask():
    x = torch.tensor([[1.0, 2.0], [3.0, float("nan")]])
    mask = torch.tensor([[True, True], [True, False]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 3.0]))
    empty = masked_mean(x, torch.zeros(2, 2, dtype=torch.bool))
    assert empty.item() == 0.0
    torch.testing.assert_close(
        masked_mean(x, torch.tensor([[True, True], [False, False]]), dim=1), torch.tensor([1.5, 0.0])
    )
    # float weights: (1*1 + 2*0.5 + 3*0) / 1.5
    w = torch.tensor([[1.0, 0.5], [0.0, 0.0]])
    assert masked_mean(x, w).item() == pytest.approx(2.0 / 1.5)
    with pytest.raises(ValueError):
        masked_mean(x, mask[0])


def test_seq_mean_vs_token_mean():
    x = torch.tensor([[1.0, 2.0], [3.0, 0.0], [9.0, 9.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    assert aggregate_loss(x, mask, reduction="token-mean").item() == pytest.approx(2.0)
    assert aggregate_loss(x, mask, reduction="seq-mean").item() == pytest.approx(2.25)  # (1.5 + 3) / 2


def test_entropy_bonus_is_masked_mean():
    ent = torch.tensor([1.0, 2.0, 100.0], requires_grad=True)
    bonus = entropy_bonus(ent, torch.tensor([True, True, False]))
    assert bonus.item() == pytest.approx(1.5)
    bonus.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([0.5, 0.5, 0.0]))


def test_normalize_advantages_population_std_and_mask():
    adv = torch.tensor([1.0, 3.0, 50.0])
    out = normalize_advantages(adv, torch.tensor([True, True, False]), eps=0.0)
    # mean 2, population std 1 (the unbiased std would be sqrt(2)); masked slot -> 0
    torch.testing.assert_close(out, torch.tensor([-1.0, 1.0, 0.0]))
    g = torch.Generator().manual_seed(0)
    big = torch.randn(100, 4, generator=g, dtype=torch.float64) * 3 + 5
    m = torch.rand(100, 4, generator=g) < 0.6
    n = normalize_advantages(big, m)
    assert masked_mean(n, m).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_mean(n**2, m).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(normalize_advantages(big, torch.zeros_like(m)), torch.zeros_like(big))
