"""Tests for tasks.algorithms.advantages: GAE and the action-level time axis (the estimator registry:
test_estimators.py)."""

import math

import pytest
import torch

from tasks.algorithms.advantages import (
    from_action_level,
    gae,
    to_action_level,
)


def _reference_gae(rewards, values, terminated, truncated, final_values, gamma, lam):
    """Independent plain-python GAE: A_t = sum_k (gamma*lam)^k delta_{t+k}, stopping after the first done."""
    T, B = len(rewards), len(rewards[0])
    adv = [[0.0] * B for _ in range(T)]
    for b in range(B):
        deltas = []
        for t in range(T):
            if terminated[t][b]:
                nxt = 0.0
            elif truncated[t][b]:
                nxt = final_values[t][b]
            else:
                nxt = values[t + 1][b]
            deltas.append(rewards[t][b] + gamma * nxt - values[t][b])
        for t in range(T):
            total, k = 0.0, 0
            while t + k < T:
                total += (gamma * lam) ** k * deltas[t + k]
                if terminated[t + k][b] or truncated[t + k][b]:
                    break
                k += 1
            adv[t][b] = total
    rets = [[adv[t][b] + values[t][b] for b in range(B)] for t in range(T)]
    return adv, rets


def _random_rollout(T, B, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, B, generator=g, dtype=dtype)
    values = torch.randn(T + 1, B, generator=g, dtype=dtype)
    terminated = torch.rand(T, B, generator=g) < 0.15
    truncated = torch.rand(T, B, generator=g) < 0.15
    final_values = torch.randn(T, B, generator=g, dtype=dtype)
    return dict(
        rewards=rewards, values=values, terminated=terminated, truncated=truncated, final_values=final_values
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_plain_loop_with_random_flags(seed):
    ro = _random_rollout(T=16, B=5, seed=seed)
    ro["terminated"][3, 0] = True  # both flags on the same step: termination wins
    ro["truncated"][3, 0] = True
    ro["truncated"][7, 1] = True  # a truncation alone
    ro["terminated"][7, 1] = False
    assert ro["terminated"].any() and ro["truncated"].any()
    gamma, lam = 0.97, 0.9
    adv, ret = gae(**ro, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _reference_gae(
        ro["rewards"].tolist(), ro["values"].tolist(), ro["terminated"].tolist(),
        ro["truncated"].tolist(), ro["final_values"].tolist(), gamma, lam,
    )
    torch.testing.assert_close(adv, torch.tensor(ref_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_gae_hand_computed_three_steps():
    # gamma = 0.9, lam = 0.5, so gamma*lam = 0.45. One env.
    # t=0: plain step.       next = values[1] = 1.0    delta0 = 1 + 0.9*1.0  - 0.5 = 1.4
    # t=1: truncated, V(final_obs) = 10 (values[2] = 2.0 is the reset obs and must NOT be used)
    #                        next = 10                 delta1 = 2 + 0.9*10   - 1.0 = 10.0
    # t=2: terminated.       next = 0 (values[3] = 4.0 unused)   delta2 = 3 + 0 - 2.0 = 1.0
    # A2 = 1.0
    # A1 = 10.0 + 0.45 * 0 * A2 = 10.0          (done at t=1 cuts the recursion)
    # A0 = 1.4 + 0.45 * 1 * 10.0 = 5.9
    # returns = A + values[:3] = [5.9 + 0.5, 10.0 + 1.0, 1.0 + 2.0] = [6.4, 11.0, 3.0]
    adv, ret = gae(
        rewards=torch.tensor([[1.0], [2.0], [3.0]]),
        values=torch.tensor([[0.5], [1.0], [2.0], [4.0]]),
        terminated=torch.tensor([[False], [False], [True]]),
        truncated=torch.tensor([[False], [True], [False]]),
        final_values=torch.tensor([[float("nan")], [10.0], [float("nan")]]),  # NaN where unused
        gamma=0.9,
        lam=0.5,
    )
    torch.testing.assert_close(adv, torch.tensor([[5.9], [10.0], [1.0]]))
    torch.testing.assert_close(ret, torch.tensor([[6.4], [11.0], [3.0]]))
    assert adv.dtype == torch.float32


def test_gae_truncation_at_last_step_bootstraps_final_value():
    # gamma = 0.5, lam = 1. t=1 truncated with V(final_obs) = 3; values[2] = 5 is the reset obs.
    # delta1 = 1 + 0.5*3 - 0 = 2.5 ; delta0 = 0 + 0.5*0 - 0 = 0 ; A0 = 0 + 0.5*1*2.5 = 1.25
    kwargs = dict(
        rewards=torch.tensor([[0.0], [1.0]], dtype=torch.float64),
        values=torch.tensor([[0.0], [0.0], [5.0]], dtype=torch.float64),
        terminated=torch.tensor([[False], [False]]),
        truncated=torch.tensor([[False], [True]]),
        final_values=torch.tensor([[0.0], [3.0]], dtype=torch.float64),
        gamma=0.5,
        lam=1.0,
    )
    adv, _ = gae(**kwargs)
    torch.testing.assert_close(adv, torch.tensor([[1.25], [2.5]], dtype=torch.float64))
    # Without the truncation flag the last step bootstraps values[2] = 5 instead.
    kwargs["truncated"] = torch.tensor([[False], [False]])
    adv2, _ = gae(**kwargs)
    torch.testing.assert_close(adv2, torch.tensor([[1.75], [3.5]], dtype=torch.float64))


def test_gae_termination_ignores_final_values_and_bootstrap():
    adv, _ = gae(
        rewards=torch.tensor([[2.0]]), values=torch.tensor([[0.5], [100.0]]),
        terminated=torch.tensor([[True]]), truncated=torch.tensor([[True]]),
        final_values=torch.tensor([[50.0]]), gamma=0.99, lam=0.95,
    )
    torch.testing.assert_close(adv, torch.tensor([[1.5]]))


@pytest.mark.parametrize(
    "field,bad",
    [
        ("values", torch.zeros(4, 3)),  # should be [T+1, B] = [5, 3]
        ("rewards", torch.zeros(4, 2)),
        ("terminated", torch.zeros(4, 3, dtype=torch.bool)[:3]),
        ("truncated", torch.zeros(4, 1, dtype=torch.bool)),
        ("final_values", torch.zeros(4)),
        ("terminated", torch.zeros(4, 3)),  # float flags, not bool
    ],
)
def test_gae_rejects_shape_and_dtype_mismatch(field, bad):
    ro = _random_rollout(T=4, B=3, seed=0)
    ro[field] = bad
    with pytest.raises(ValueError):
        gae(**ro, gamma=0.99, lam=0.95)


def test_gae_rejects_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        gae(**_random_rollout(T=2, B=2, seed=0), gamma=1.5, lam=0.95)


def _chunk_rollout(T, B, C, seed):
    g = torch.Generator().manual_seed(seed)
    return dict(
        rewards=torch.randn(T, B, C, generator=g, dtype=torch.float64),
        values=torch.randn(T + 1, B, C, generator=g, dtype=torch.float64),
        terminated=torch.zeros(T, B, dtype=torch.bool),
        truncated=torch.zeros(T, B, dtype=torch.bool),
        final_values=torch.randn(T, B, generator=g, dtype=torch.float64),
        step_mask=torch.ones(T, B, C, dtype=torch.bool),
    )


def test_action_level_round_trip():
    T, B, C = 3, 2, 4
    ro = _chunk_rollout(T, B, C, seed=0)
    out = to_action_level(**ro)
    assert out["rewards"].shape == (T * C, B)
    assert out["values"].shape == (T * C + 1, B)
    # time index t*C + c
    assert out["rewards"][1 * C + 2, 1] == ro["rewards"][1, 1, 2]
    torch.testing.assert_close(from_action_level(out["rewards"], num_action_chunks=C), ro["rewards"])
    torch.testing.assert_close(from_action_level(out["values"][:-1], num_action_chunks=C), ro["values"][:T])
    torch.testing.assert_close(out["values"][-1], ro["values"][T, :, 0])
    with pytest.raises(ValueError):
        from_action_level(out["rewards"], num_action_chunks=5)  # 12 rows, 5 does not divide


def test_action_level_done_placed_at_last_executed_action():
    T, B, C = 2, 2, 3
    ro = _chunk_rollout(T, B, C, seed=1)
    # env 0 terminates after the 2nd action of chunk step 0: its 3rd action is not executed
    ro["terminated"][0, 0] = True
    ro["step_mask"][0, 0, 2] = False
    # env 1 is truncated at the end of chunk step 1 (full chunk executed)
    ro["truncated"][1, 1] = True
    ro["final_values"][1, 1] = 7.0
    out = to_action_level(**ro)
    expected_term = torch.zeros(T * C, B, dtype=torch.bool)
    expected_term[0 * C + 1, 0] = True
    expected_trunc = torch.zeros(T * C, B, dtype=torch.bool)
    expected_trunc[1 * C + 2, 1] = True
    assert torch.equal(out["terminated"], expected_term)
    assert torch.equal(out["truncated"], expected_trunc)
    # final_values sit at each chunk's last executed action (index 1 for env 0 at t=0, else C-1), 0 elsewhere
    expected_fv = torch.zeros(T * C, B, dtype=torch.float64)
    for t, b, last in [(0, 0, 1), (0, 1, 2), (1, 0, 2), (1, 1, 2)]:
        expected_fv[t * C + last, b] = ro["final_values"][t, b]
    torch.testing.assert_close(out["final_values"], expected_fv, rtol=0, atol=0)
    assert out["final_values"][5, 1] == 7.0
    assert out["rewards"][2, 0] == 0.0  # not-executed action carries no reward

    adv, _ = gae(**out, gamma=0.9, lam=0.8)
    # the terminated action's advantage is just r - V (no bootstrap, no recursion)
    torch.testing.assert_close(adv[1, 0], ro["rewards"][0, 0, 1] - ro["values"][0, 0, 1])
    # the truncated action bootstraps V(final_obs) = 7
    torch.testing.assert_close(adv[5, 1], ro["rewards"][1, 1, 2] + 0.9 * 7.0 - ro["values"][1, 1, 2])


@pytest.mark.parametrize("bad_mask", [[True, False, True], [False, False, False]])
def test_action_level_rejects_bad_step_mask(bad_mask):
    ro = _chunk_rollout(1, 1, 3, seed=0)
    ro["step_mask"] = torch.tensor([[bad_mask]])
    ro["terminated"][0, 0] = True  # an empty chunk (an idle env) is fine, one that ends an episode is not
    with pytest.raises(ValueError, match="step_mask"):
        to_action_level(**ro)


def test_action_level_rejects_shape_mismatch():
    ro = _chunk_rollout(2, 2, 3, seed=0)
    ro["values"] = ro["values"][:2]  # [T, B, C] instead of [T+1, B, C]
    with pytest.raises(ValueError, match="values"):
        to_action_level(**ro)


def test_action_level_with_one_action_equals_chunk_level_gae():
    T, B = 12, 4
    ro = _chunk_rollout(T, B, 1, seed=3)
    g = torch.Generator().manual_seed(4)
    ro["terminated"] = torch.rand(T, B, generator=g) < 0.2
    ro["truncated"] = torch.rand(T, B, generator=g) < 0.2
    adv_a, ret_a = gae(**to_action_level(**ro), gamma=0.95, lam=0.9)
    adv_c, ret_c = gae(
        rewards=ro["rewards"][..., 0], values=ro["values"][..., 0], terminated=ro["terminated"],
        truncated=ro["truncated"], final_values=ro["final_values"], gamma=0.95, lam=0.9,
    )
    torch.testing.assert_close(adv_a, adv_c, rtol=0, atol=0)
    torch.testing.assert_close(ret_a, ret_c, rtol=0, atol=0)
    assert not math.isnan(adv_a.sum().item())
