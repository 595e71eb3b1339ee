"""The tie rule of every std normalisation (tasks.algorithms.ties): scores equal up to rounding
relative to their magnitude are a tie (advantages exactly 0 in GRPO, RLOO and the batch normalisation); a genuine
difference still gets the formula's advantages (checked against a plain loop of the formula)."""

import math

import pytest
import torch

from tasks.algorithms import TIE_ULPS, grpo_advantages, is_tie, normalize_advantages, tie_tolerance
from tasks.algorithms.rloo import rloo_advantages

MAGNITUDES = (1e-3, 1.0, 25.0, 1000.0, 1e6, -25.0)
DTYPES = (torch.float32, torch.float64)


def _ulps_up(x: float, k: int, dtype) -> float:
    """x moved up by k ulps in dtype (k nextafter steps)."""
    t = torch.tensor(x, dtype=dtype)
    for _ in range(k):
        t = torch.nextafter(t, torch.tensor(math.inf, dtype=dtype))
    return float(t)


def _group_inputs(scores, dtype):
    """One chunk step, B envs in one group, each env's reward = its score (no done: the step is scored)."""
    B = len(scores)
    rewards = torch.tensor([scores], dtype=dtype)  # [T=1, B]
    flags = torch.zeros(1, B, dtype=torch.bool)
    return dict(rewards=rewards, terminated=flags, truncated=flags, step_mask=torch.ones(1, B, 1, dtype=torch.bool),
                group_size=B)


def _near_ties(x, dtype):
    """Groups whose scores differ by rounding noise only: 1 ulp (the issue's two inputs) and a few ulps."""
    return [[x, x, x, _ulps_up(x, 1, dtype)], [x, _ulps_up(x, 1, dtype), x, x],
            [_ulps_up(x, 3, dtype), x, _ulps_up(x, 7, dtype), x, _ulps_up(x, 1, dtype), x]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x", MAGNITUDES)
def test_rounding_noise_is_a_tie_everywhere_a_std_normalises(x, dtype):
    for scores in _near_ties(x, dtype):
        assert len(set(scores)) > 1  # the scores really differ (in dtype)
        g = grpo_advantages(**_group_inputs(scores, dtype))
        assert torch.equal(g["advantages"], torch.zeros_like(g["advantages"])), (x, dtype, scores, g["advantages"])
        assert float(g["group_std"][0]) == 0.0
        r = rloo_advantages(**_group_inputs(scores, dtype))
        assert torch.equal(r["advantages"], torch.zeros_like(r["advantages"])), (x, dtype, scores, r["advantages"])
        adv = torch.tensor(scores, dtype=dtype)
        out = normalize_advantages(adv, torch.ones_like(adv, dtype=torch.bool))
        assert torch.equal(out, torch.zeros_like(out)), (x, dtype, scores, out)


def test_the_issue_inputs_give_zero_advantages():
    f32 = torch.float32
    for scores in ([25.0, 25.0, 25.0, _ulps_up(25.0, 1, f32)], [1000.0, _ulps_up(1000.0, 1, f32), 1000.0, 1000.0]):
        assert grpo_advantages(**_group_inputs(scores, f32))["advantages"].abs().max() == 0


def _loop_grpo(scores, eps=1e-6):
    n = len(scores)
    mean = sum(scores) / n
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (n - 1))
    return [(s - mean) / (std + eps) for s in scores]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_genuine_1e3_difference_still_counts(dtype):
    scores = [1.0, 1.0, 1.0, 1.001]
    vals = [float(torch.tensor(s, dtype=dtype)) for s in scores]  # the scores as the dtype holds them
    # the dtype's arithmetic on a spread 1e3 times below the values loses ~1e3 * eps relative (cancellation)
    tol = dict(rtol=1e4 * torch.finfo(dtype).eps, atol=1e4 * torch.finfo(dtype).eps)
    g = grpo_advantages(**_group_inputs(scores, dtype))["advantages"][0]
    expected = torch.tensor(_loop_grpo(vals), dtype=torch.float64)
    torch.testing.assert_close(g.double(), expected, **tol)
    assert abs(float(g[3])) > 1.0  # full size: (3/4 * d) / (d / 2) = 1.5
    r = rloo_advantages(**_group_inputs(scores, dtype))["advantages"][0]
    loo = [vals[b] - (sum(vals) - vals[b]) / (len(vals) - 1) for b in range(len(vals))]
    torch.testing.assert_close(r.double(), torch.tensor(loo, dtype=torch.float64), rtol=tol["rtol"], atol=1e-9)
    adv = torch.tensor(scores, dtype=dtype)
    out = normalize_advantages(adv, torch.ones_like(adv, dtype=torch.bool))
    mean = sum(vals) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4)  # population std
    torch.testing.assert_close(out.double(), torch.tensor([(v - mean) / (std + 1e-8) for v in vals],
                                                          dtype=torch.float64), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x", MAGNITUDES)
def test_is_tie_boundary_follows_the_definition(x, dtype):
    """spread <= TIE_ULPS * eps * max|x| is a tie; twice that is not."""
    eps = torch.finfo(dtype).eps
    m = abs(x)
    tol = TIE_ULPS * eps * m
    assert math.isclose(float(tie_tolerance(torch.tensor(m, dtype=dtype), dtype)), tol, rel_tol=1e-6)
    inside = torch.tensor([x, x + 0.5 * tol], dtype=dtype)
    outside = torch.tensor([x, x + 2.5 * tol], dtype=dtype)
    assert bool(is_tie(inside)) and not bool(is_tie(outside))


def test_is_tie_members_dims_and_edges():
    x = torch.tensor([[1.0, 1.0, float("nan")], [1.0, 2.0, 1.0], [0.0, 0.0, 0.0], [5.0, float("inf"), 5.0]])
    member = torch.tensor([[True, True, False], [True, True, True], [True, True, True], [True, True, True]])
    assert is_tie(x, member=member, dim=-1).tolist() == [True, False, True, False]  # NaN outside: never read
    assert bool(is_tie(torch.tensor([3.0]))) and bool(is_tie(torch.zeros(0)))  # nothing to spread
    assert bool(is_tie(torch.tensor([2.0, 7.0]), member=torch.tensor([False, True])))
    with pytest.raises(ValueError, match="floating-point"):
        is_tie(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="member"):
        is_tie(torch.tensor([1.0, 1.0]), member=torch.tensor([True]))


def test_grpo_with_env_mask_ties_over_the_members_only():
    """Env 3 is left out (masked): the remaining members {25, 25, 25 + 1 ulp} are a tie -> all zero; and a masked
    env with a genuinely different score does not break the tie of the others."""
    f32 = torch.float32
    scores = [25.0, 25.0, _ulps_up(25.0, 1, f32), 40.0]
    inp = _group_inputs(scores, f32)
    out = grpo_advantages(**inp, env_mask=torch.tensor([True, True, True, False]))
    assert torch.equal(out["advantages"], torch.zeros_like(out["advantages"]))
    r = rloo_advantages(**inp, env_mask=torch.tensor([True, True, True, False]))
    assert torch.equal(r["advantages"], torch.zeros_like(r["advantages"]))
