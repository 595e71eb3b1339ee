"""flow_sampling, the piRL samplers every flow family (pi0, pi05) uses: the time grid, Flow-SDE's sigmas, the
stochastic transitions' log-probs and entropies recomputed by hand from a fixed velocity field."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributions import Normal

from tasks.policies.flow_sampling import NoiseStdHead, chain_logprobs, sample_chain, sde_sigmas, time_grid

N, C, A, K, W = 3, 4, 2, 4, 8


def _field(seed=0):
    """A fixed velocity field v(x [N, C, A], t [N]) -> (v, features [N, C, W])."""
    torch.manual_seed(seed)
    lin, out = nn.Linear(A + 1, W), nn.Linear(W, A)

    def velocity(x, t):
        feats = torch.tanh(lin(torch.cat([x, t[:, None, None].expand(-1, x.shape[1], 1)], dim=-1)))
        return out(feats), feats
    return velocity


def test_time_grid_and_sde_sigmas_by_hand():
    assert time_grid(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    a = 0.5  # sigma_k = a sqrt(t / (1 - t)); at t = 1 the denominator is 1 - t_1 = 1/K (RLinf's clamp)
    expected = [a * math.sqrt(1 / 0.25), a * math.sqrt(0.75 / 0.25), a * math.sqrt(0.5 / 0.5), a * math.sqrt(0.25 / 0.75)]
    torch.testing.assert_close(sde_sigmas(4, a), torch.tensor(expected))


@torch.no_grad()
def test_flow_sde_transition_logprob_equals_direct_computation():
    velocity = _field()
    torch.manual_seed(3)
    x0, chain, logp, idx = sample_chain(velocity, torch.randn(N, C, A), num_steps=K, noise_level=0.5,
                                        noise_head=None, deterministic=False)
    assert chain.shape == (N, K + 1, C, A) and idx.dtype == torch.int64 and ((0 <= idx) & (idx < K)).all()
    delta = 1.0 / K
    for b in range(N):
        for k in range(K):
            x, x_next = chain[b:b + 1, k], chain[b:b + 1, k + 1]
            t = 1.0 - k / K
            v, _ = velocity(x, torch.tensor([t]))
            if k == idx[b]:  # the one SDE step: x - delta [v + sigma^2/(2t) (x + (1-t) v)], std sqrt(delta) sigma
                sigma = 0.5 * math.sqrt(t / (1.0 - t)) if k > 0 else 0.5 * math.sqrt(1.0 / delta)
                mean = x - delta * (v + sigma ** 2 / (2 * t) * (x + (1 - t) * v))
                lp = Normal(mean, math.sqrt(delta) * sigma).log_prob(x_next)
                torch.testing.assert_close(logp[b:b + 1], lp, atol=1e-5, rtol=1e-5)
                assert not torch.allclose(x_next, x - delta * v, atol=1e-3)  # noise was really injected
            else:  # deterministic Euler steps
                torch.testing.assert_close(x_next, x - delta * v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x0, chain[:, -1])
    ev, ent = chain_logprobs(velocity, chain, idx, num_steps=K, noise_level=0.5, noise_head=None)
    torch.testing.assert_close(ev, logp)  # evaluate = act: ratio 1 with unchanged parameters
    std = math.sqrt(delta) * sde_sigmas(K, 0.5)[idx]  # [N]: the entropy is the transition Gaussian's
    torch.testing.assert_close(ent, Normal(0.0, std).entropy()[:, None, None].expand(N, C, A))


@torch.no_grad()
def test_flow_noise_logprob_is_the_mean_over_all_steps_with_bounded_std():
    velocity = _field()
    head = NoiseStdHead(W, A, 0.08, 0.16)
    torch.nn.init.normal_(head.mlp[-1].weight, std=1.0)  # a non-constant std
    torch.manual_seed(4)
    _, chain, logp, idx = sample_chain(velocity, torch.randn(N, C, A), num_steps=K, noise_level=0.5,
                                       noise_head=head, deterministic=False)
    total = torch.zeros(N, C, A)
    for k in range(K):
        v, feats = velocity(chain[:, k], time_grid(K)[k].expand(N))
        std = head(feats)
        assert (std >= 0.08 - 1e-6).all() and (std <= 0.16 + 1e-6).all() and std.std() > 0
        total += Normal(chain[:, k] - v / K, std).log_prob(chain[:, k + 1])
    torch.testing.assert_close(logp, total / K, atol=1e-4, rtol=1e-5)  # RLinf: mean over steps
    assert (idx == -1).all()
    torch.testing.assert_close(chain_logprobs(velocity, chain, idx, num_steps=K, noise_level=0.5,
                                              noise_head=head)[0], logp, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_deterministic_chain_is_the_euler_ode_with_zero_logprob():
    velocity = _field()
    x1 = torch.randn(N, C, A)
    x0, _, logp, idx = sample_chain(velocity, x1, num_steps=K, noise_level=0.5, noise_head=None, deterministic=True)
    x = x1
    for k in range(K):
        x = x - velocity(x, time_grid(K)[k].expand(N))[0] / K
    torch.testing.assert_close(x0, x)
    assert (logp == 0).all() and (idx == -1).all()
