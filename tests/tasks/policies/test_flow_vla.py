"""flow_vla: the pi0-style flow-matching VLA and the piRL samplers (Flow-SDE, Flow-Noise), tiny sizes on CPU."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributions import Normal

from tasks.config import ConfigError, PolicyConfig
from tasks.policies.flow_vla.configuration import FlowVLAConfig
from tasks.policies import check_policy_config, make_policy
from tasks.policies.flow_vla.model import FlowVLAPolicy, sde_sigmas, time_grid

O, D, C, K, IMG = 5, 3, 4, 4, 16  # D < A = 8 (tiny preset): the slicing is exercised everywhere


def _cfg(**kw) -> PolicyConfig:
    base = dict(name="flow_vla", preset="tiny", num_action_chunks=C, num_denoise_steps=K, max_prompt_len=12)
    return FlowVLAConfig(**{**base, **kw})


def _policy(image_size=IMG, num_values=1, seed=0, **kw) -> FlowVLAPolicy:
    torch.manual_seed(seed)
    return FlowVLAPolicy(_cfg(**kw), O, D, num_values, image_size=image_size)


def _obs(policy, B=3, image_size=IMG, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = {"prompt": policy.tokenize(["pick up the cube", "push", "open the drawer"][:B] * (B // 3 + 1))[:B],
           "state": torch.randn(B, O, generator=g)}
    if image_size:
        obs["rgb"] = torch.randint(0, 256, (B, image_size, image_size, 3), dtype=torch.uint8, generator=g)
    return obs


def _velocity(policy, obs, x, k):
    """The model's velocity at chain state x [B, C, A], grid index k (int)."""
    pre = policy.prefix(obs, with_kv=True)
    t = torch.full((x.shape[0],), float(time_grid(policy.K)[k]))
    return policy._velocity(pre.kv, pre.mask, x, t)


def test_time_grid_and_sde_sigmas_by_hand():
    assert time_grid(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    a = 0.5  # sigma_k = a sqrt(t / (1 - t)); at t = 1 the denominator is 1 - t_1 = 1/K (RLinf's clamp)
    expected = [a * math.sqrt(1 / 0.25), a * math.sqrt(0.75 / 0.25), a * math.sqrt(0.5 / 0.5), a * math.sqrt(0.25 / 0.75)]
    torch.testing.assert_close(sde_sigmas(4, a), torch.tensor(expected))


@torch.no_grad()
def test_flow_sde_transition_logprob_equals_direct_computation():
    policy = _policy(noise_method="flow_sde", noise_level=0.5).eval()
    obs = _obs(policy)
    torch.manual_seed(3)
    out = policy.act(obs)
    chain, idx = out["extras"]["chain"], out["extras"]["denoise_idx"]
    assert chain.shape == (3, K + 1, C, 8) and idx.dtype == torch.int64 and ((0 <= idx) & (idx < K)).all()
    delta = 1.0 / K
    for b in range(3):
        ob = {k: v[b:b + 1] for k, v in obs.items()}
        for k in range(K):
            x, x_next = chain[b:b + 1, k], chain[b:b + 1, k + 1]
            v, _ = _velocity(policy, ob, x, k)
            t = 1.0 - k / K
            if k == idx[b]:  # the one SDE step: x - delta [v + sigma^2/(2t) (x + (1-t) v)], std sqrt(delta) sigma
                sigma = 0.5 * math.sqrt(t / (1.0 - t)) if k > 0 else 0.5 * math.sqrt(1.0 / delta)
                mean = x - delta * (v + sigma ** 2 / (2 * t) * (x + (1 - t) * v))
                lp = Normal(mean, math.sqrt(delta) * sigma).log_prob(x_next)[..., :D]
                torch.testing.assert_close(out["logprobs"][b:b + 1], lp, atol=1e-5, rtol=1e-5)
                assert not torch.allclose(x_next, x - delta * v, atol=1e-3)  # noise was really injected
            else:  # deterministic Euler steps
                torch.testing.assert_close(x_next, x - delta * v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["actions"], chain[:, -1, :, :D])


@torch.no_grad()
def test_flow_noise_logprob_is_the_mean_over_all_steps_with_bounded_std():
    policy = _policy(noise_method="flow_noise", noise_std_min=0.08, noise_std_max=0.16).eval()
    torch.nn.init.normal_(policy.noise_head.mlp[-1].weight, std=1.0)  # a non-constant std
    obs = _obs(policy)
    torch.manual_seed(4)
    out = policy.act(obs)
    chain = out["extras"]["chain"]
    total = torch.zeros(3, C, D)
    for k in range(K):
        v, feats = _velocity(policy, obs, chain[:, k], k)
        std = policy.noise_head(feats)
        assert (std >= 0.08 - 1e-6).all() and (std <= 0.16 + 1e-6).all() and std.std() > 0
        total += Normal(chain[:, k] - v / K, std).log_prob(chain[:, k + 1])[..., :D]
    torch.testing.assert_close(out["logprobs"], total / K, atol=1e-4, rtol=1e-5)  # RLinf: mean over steps
    assert (out["extras"]["denoise_idx"] == -1).all()


@pytest.mark.parametrize("noise_method", ["flow_sde", "flow_noise"])
@pytest.mark.parametrize("num_values", [1, C])
def test_evaluate_reproduces_act_logprobs_and_values(noise_method, num_values):
    policy = _policy(noise_method=noise_method, num_values=num_values)
    obs = _obs(policy)
    torch.manual_seed(5)
    out = policy.act(obs)
    ev = policy.evaluate(obs, out["actions"], out["extras"])
    assert ev["logprobs"].shape == ev["entropy"].shape == (3, C, D)
    assert out["values"].shape == ev["values"].shape == ((3,) if num_values == 1 else (3, C))
    ratio = torch.exp(ev["logprobs"] - out["logprobs"])
    assert (ratio - 1).abs().max().item() < 1e-6
    torch.testing.assert_close(ev["values"], out["values"], atol=1e-6, rtol=1e-6)
    assert torch.isfinite(ev["entropy"]).all()
    # differentiable: the PPO surrogate reaches the action expert and the prefix LM (and the noise head)
    (ev["logprobs"].sum() + ev["values"].sum()).backward()
    names = ["expert.layers.0.self_attn.q_proj.weight", "prefix.lm.layers.0.self_attn.k_proj.weight",
             "prefix.vision.encoder.layers.0.mlp.fc1.weight", "action_out_proj.weight",
             "value_head.mlp.0.weight"] + (["noise_head.mlp.4.weight"] if noise_method == "flow_noise" else [])
    for name in names:
        grad = dict(policy.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_flow_sde_entropy_is_the_transition_gaussians():
    policy = _policy(noise_method="flow_sde", image_size=None)
    obs = _obs(policy, image_size=None)
    out = policy.act(obs)
    ev = policy.evaluate(obs, out["actions"], out["extras"])
    std = math.sqrt(1 / K) * sde_sigmas(K, 0.5)[out["extras"]["denoise_idx"]]  # [B]
    torch.testing.assert_close(ev["entropy"], Normal(0.0, std).entropy()[:, None, None].expand(3, C, D))


def test_deterministic_act_is_the_plain_ode():
    policy = _policy()
    obs = _obs(policy)
    torch.manual_seed(0)
    a = policy.act(obs, deterministic=True)
    torch.manual_seed(0)
    b = policy.act(obs, deterministic=True)
    torch.testing.assert_close(a["actions"], b["actions"], atol=0, rtol=0)
    assert (a["logprobs"] == 0).all() and (a["extras"]["denoise_idx"] == -1).all()
    chain = a["extras"]["chain"]
    v, _ = _velocity(policy, obs, chain[:, 2], 2)
    torch.testing.assert_close(chain[:, 3], chain[:, 2] - v / K, atol=1e-5, rtol=1e-5)
    # the same initial noise through act(noise=...) gives the same actions; another noise does not
    c = policy.act(obs, deterministic=True, noise=chain[:, 0])
    torch.testing.assert_close(c["actions"], a["actions"], atol=0, rtol=0)
    assert not torch.allclose(policy.act(obs, deterministic=True)["actions"], a["actions"])


@pytest.mark.parametrize("noise_method", ["flow_sde", "flow_noise"])
def test_save_pretrained_roundtrip_identical_actions(tmp_path: Path, noise_method):
    policy = _policy(noise_method=noise_method, num_values=C)
    policy.save_pretrained(tmp_path / "ckpt")
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= names
    loaded = FlowVLAPolicy.from_pretrained(tmp_path / "ckpt")
    assert loaded.cfg.noise_method == noise_method and loaded.num_values == C and loaded.image_size == IMG
    obs = _obs(policy)
    assert torch.equal(loaded.tokenize(["pick up the cube"]), policy.tokenize(["pick up the cube"]))
    outs = []
    for p in (policy, loaded):
        torch.manual_seed(11)
        outs.append(p.act(obs))
    for key in ("actions", "logprobs", "values"):
        torch.testing.assert_close(outs[0][key], outs[1][key], atol=0, rtol=0)
    torch.testing.assert_close(outs[0]["extras"]["chain"], outs[1]["extras"]["chain"], atol=0, rtol=0)
    # the registry's path: make_policy with policy.model_path loads the same weights into a fresh policy
    cfg = _cfg(noise_method=noise_method, model_path=str(tmp_path / "ckpt"))
    fresh = make_policy(cfg, obs_dim=O, action_dim=D, num_values=C, seed=123, image_size=IMG)
    torch.manual_seed(11)
    torch.testing.assert_close(fresh.act(obs)["actions"], outs[0]["actions"], atol=0, rtol=0)


def test_state_only_env_and_shapes():
    policy = make_policy(_cfg(use_state=True), obs_dim=O, action_dim=D, seed=0)  # image_size None
    assert policy.prefix.vision is None and policy.needs_prompt
    obs = _obs(policy, B=3, image_size=None)
    out = policy.act(obs)
    assert out["actions"].shape == out["logprobs"].shape == (3, C, D) and out["values"].shape == (3,)
    assert policy.values(obs).shape == (3,)
    with pytest.raises(KeyError):
        policy.act({"state": obs["state"]})


def test_sft_loss_overfits_a_fixed_batch():
    policy = _policy(image_size=None, seed=0)
    obs = _obs(policy, image_size=None)
    actions = torch.tanh(torch.randn(3, C, D, generator=torch.Generator().manual_seed(7)))

    def fixed_loss():
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(99)
            return sum(policy.sft_loss(obs, actions).item() for _ in range(8)) / 8

    def ode_error():
        torch.manual_seed(0)
        return (policy.act(obs, deterministic=True)["actions"] - actions).abs().mean().item()

    before, err_before = fixed_loss(), ode_error()
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(60):
        opt.zero_grad()
        policy.sft_loss(obs, actions).backward()
        opt.step()
    after = fixed_loss()
    assert after < 0.5 * before, (before, after)
    # the trained ODE (K = 4 Euler steps) lands much nearer to the demonstrations than before training
    err_after = ode_error()
    print(f"sft loss {before:.3f} -> {after:.3f}; ODE |a - a*| {err_before:.3f} -> {err_after:.3f}")
    assert err_after < 0.6 * err_before, (err_before, err_after)


def test_config_errors():
    with pytest.raises(ConfigError) as e:
        check_policy_config(_cfg(noise_method="ddpm"))
    assert e.value.key == "policy.noise_method"
    with pytest.raises(ConfigError) as e:
        check_policy_config(_cfg(sizes={"lm_depth": 3}))
    assert e.value.key == "policy.sizes" and "lm_layers" in str(e.value)
    with pytest.raises(ConfigError):
        check_policy_config(_cfg(noise_method="flow_noise", noise_std_min=0.2, noise_std_max=0.1))
    with pytest.raises(ConfigError):
        check_policy_config(_cfg(value_head="max_token"))
    with pytest.raises(ConfigError) as e:
        FlowVLAPolicy(_cfg(), O, 9, 1)  # D = 9 > A = 8
    assert "action_dim" in str(e.value)
    check_policy_config(_cfg(sizes={"action_dim": 16}))


def test_pi0_preset_parameter_count_on_meta_device():
    with torch.device("meta"):
        policy = FlowVLAPolicy(_cfg(preset="pi0", num_action_chunks=50, num_denoise_steps=10), 8, 7, 1,
                               image_size=224)
    assert all(p.device.type == "meta" for p in policy.parameters())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert 3.1e9 < count(policy) < 3.4e9  # pi0: ~3.3B (PaliGemma 3B + a 300M action expert)
    assert 0.39e9 < count(policy.prefix.vision) < 0.43e9  # SigLIP So400m/14
    assert 2.4e9 < count(policy.prefix.lm) < 2.6e9  # Gemma 2B with the 257k PaliGemma vocabulary
    assert 0.28e9 < count(policy.expert) < 0.34e9  # Gemma 300M expert
    assert policy.prefix.num_patches == 256


def test_asymmetric_critic_reads_the_state_the_actor_does_not():
    """policy.critic_state with a vision-only actor (use_state False): the value changes with the state while the
    actions (same noise) do not; the value head's first layer takes [W + O] inputs."""
    policy = _policy(use_state=False, critic_state=True, value_detach=True)
    assert policy.value_head.mlp[0].in_features == policy.sizes["lm_width"] + O
    obs = _obs(policy)
    moved = {**obs, "state": obs["state"] + 1.0}
    noise = torch.randn(3, C, policy.A, generator=torch.Generator().manual_seed(0))
    a, b = policy.act(obs, deterministic=True, noise=noise), policy.act(moved, deterministic=True, noise=noise)
    torch.testing.assert_close(a["actions"], b["actions"])
    assert (a["values"] - b["values"]).abs().min() > 1e-4
    torch.testing.assert_close(policy.values(moved), b["values"])
