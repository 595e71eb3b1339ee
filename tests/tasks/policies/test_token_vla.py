"""Tests for tasks.policies.token_vla.model: action tokens, log-probs at every granularity, ratio 1, save/load, SFT,
the real-size preset on the meta device."""

import json

import numpy as np
import pytest
import torch

from tasks.algorithms import LOGPROB_TYPES, reduce_logprobs
from tasks.config import Config, ConfigError, PolicyConfig, check_config
from tasks.policies.token_vla.configuration import TokenVLAConfig
from tasks.policies import check_policy_config, make_policy
from tasks.policies.token_vla.model import (TokenVLAPolicy, action_stats_from_data, bin_centers, normalized_to_bins,
                                      read_action_stats)

C, D, O = 2, 3, 5


def _cfg(**kw) -> PolicyConfig:
    return TokenVLAConfig(**{"name": "token_vla", "num_action_chunks": C, "max_prompt_len": 12, **kw})


@pytest.fixture(scope="module")
def policy() -> TokenVLAPolicy:
    torch.manual_seed(0)
    return TokenVLAPolicy(_cfg(), obs_dim=O, action_dim=D)


def _obs(p: TokenVLAPolicy, B: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    texts = ["push the cube to the goal", "pick"] * B
    obs = {"prompt": p.tokenize(texts[:B]), "state": torch.randn(B, O, generator=g)}
    if p.image_size is not None:
        obs["rgb"] = torch.randint(0, 256, (B, p.image_size, p.image_size, 3), generator=g, dtype=torch.uint8)
    return obs


STATS = (torch.tensor([-0.5, 0.0, -2.0]), torch.tensor([0.5, 0.1, 3.0]))


# ------------------------------------------------------------------------------------------------ action tokens
def test_bin_centers_and_digitisation():
    c = bin_centers(4)
    torch.testing.assert_close(c, torch.tensor([-0.75, -0.25, 0.25, 0.75]))
    x = torch.tensor([-1.0, -0.5001, -0.5, 0.0, 0.9999, 1.0, 7.0, -7.0])
    assert normalized_to_bins(x, 4).tolist() == [0, 0, 1, 2, 3, 3, 3, 0]


@pytest.mark.parametrize("stats", [None, STATS])
def test_bins_actions_bins_round_trip_is_exact(stats):
    p = TokenVLAPolicy(_cfg(), obs_dim=O, action_dim=D)
    if stats is not None:
        p.set_action_stats(*stats)
    tokens = torch.arange(p.bins).view(-1, 1).expand(p.bins, D)  # every token in every dimension
    assert torch.equal(p.actions_to_bins(p.bins_to_actions(tokens)), tokens)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 256\)"):
        p.bins_to_actions(torch.tensor([[0, 256, 1]]))


@pytest.mark.parametrize("stats", [None, STATS])
def test_actions_bins_actions_within_half_a_bin(stats):
    p = TokenVLAPolicy(_cfg(), obs_dim=O, action_dim=D)
    if stats is not None:
        p.set_action_stats(*stats)
    q01, q99 = p.action_stats
    g = torch.Generator().manual_seed(0)
    a = q01 + (q99 - q01) * torch.rand(1000, C, D, generator=g)  # inside [q01, q99]
    a[0, 0], a[0, 1] = q01, q99  # the bounds themselves
    err = (p.bins_to_actions(p.actions_to_bins(a)) - a).abs()
    half_bin = (q99 - q01) / p.bins / 2
    assert (err <= half_bin + 1e-6).all()
    # outside [q01, q99] actions are clipped to the bounds (OpenVLA's clip of the normalised action)
    far = torch.stack([q01 - 5.0, q99 + 5.0])  # [2, D]
    back = p.bins_to_actions(p.actions_to_bins(far))
    assert (back[0] - q01).abs().le(half_bin + 1e-6).all() and (back[1] - q99).abs().le(half_bin + 1e-6).all()


def test_action_stats_from_data_and_setter():
    g = np.random.default_rng(0)
    acts = g.normal(size=(500, C, D)) * np.array([1.0, 2.0, 0.1])
    q01, q99 = action_stats_from_data(acts)
    flat = acts.reshape(-1, D)
    np.testing.assert_allclose(q01.numpy(), np.percentile(flat, 1, axis=0), rtol=1e-6)
    np.testing.assert_allclose(q99.numpy(), np.percentile(flat, 99, axis=0), rtol=1e-6)
    q01_t, _ = action_stats_from_data(torch.as_tensor(acts))
    torch.testing.assert_close(q01_t, q01)
    p = TokenVLAPolicy(_cfg(), obs_dim=O, action_dim=D)
    p.set_action_stats(q01, q99)
    torch.testing.assert_close(p.action_q99, q99)
    p.action_stats = STATS  # the attribute tasks.policies.load_pretrained copies
    torch.testing.assert_close(p.action_q01, STATS[0])
    with pytest.raises(ValueError, match=r"\[D=3\]"):
        p.set_action_stats([0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="q01 must be <= q99"):
        p.set_action_stats([0.0, 2.0, 0.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="non-empty"):
        action_stats_from_data(np.zeros((0, D)))


# ---------------------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_at_every_granularity_match_log_softmax(policy, temperature):
    policy.temperature = temperature
    try:
        obs = _obs(policy, 4)
        torch.manual_seed(1)
        out = policy.act(obs)
        assert out["actions"].shape == out["logprobs"].shape == (4, C, D)
        assert out["extras"]["tokens"].dtype == torch.int64 and out["values"].shape == (4,)
        with torch.no_grad():
            logits, _ = policy.forward_tokens(obs)  # [B, C, D, bins]
        direct = torch.log_softmax(logits / temperature, -1).gather(-1, out["extras"]["tokens"][..., None])[..., 0]
        step_mask = torch.tensor([[True, True], [True, False], [True, True], [True, False]])  # [B, C]
        expected = {"token_level": direct * step_mask[..., None],
                    "action_level": (direct.sum(-1) * step_mask),
                    "chunk_level": (direct.sum(-1) * step_mask).sum(-1)}
        for lt in LOGPROB_TYPES:
            got = reduce_logprobs(out["logprobs"], step_mask=step_mask, logprob_type=lt)
            torch.testing.assert_close(got, expected[lt])
        # the env action is the chosen token's bin centre
        torch.testing.assert_close(out["actions"], policy.bins_to_actions(out["extras"]["tokens"]))
    finally:
        policy.temperature = 1.0


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_evaluate_reproduces_act_ratio_one(policy, temperature):
    policy.temperature = temperature
    try:
        obs = _obs(policy, 3, seed=2)
        torch.manual_seed(3)
        out = policy.act(obs)
        ev = policy.evaluate(obs, out["actions"], out["extras"])
        torch.testing.assert_close(ev["logprobs"], out["logprobs"], rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.exp(ev["logprobs"] - out["logprobs"]), torch.ones(3, C, D))
        torch.testing.assert_close(ev["values"], out["values"], rtol=0, atol=1e-5)
        # without extras the tokens are recomputed from the actions: the same log-probs
        ev2 = policy.evaluate(obs, out["actions"], {})
        torch.testing.assert_close(ev2["logprobs"], out["logprobs"], rtol=0, atol=1e-5)
        # entropy of the tempered categorical, [N, C, D]
        with torch.no_grad():
            logits, _ = policy.forward_tokens(obs)
        ent = torch.distributions.Categorical(logits=logits / temperature).entropy()
        torch.testing.assert_close(ev["entropy"], ent, rtol=1e-5, atol=1e-5)
        assert ev["entropy"].shape == (3, C, D)
        # differentiable
        (ev["logprobs"].sum() + ev["values"].sum() + ev["entropy"].sum()).backward()
        assert policy.action_head.weight.grad is not None and policy.action_queries.grad is not None
        assert policy.value_head.mlp[0].weight.grad is not None
        policy.zero_grad(set_to_none=True)
        # deterministic: argmax tokens, and the same log-probs in evaluate
        det = policy.act(obs, deterministic=True)
        assert torch.equal(det["extras"]["tokens"], logits.argmax(-1))
        ev3 = policy.evaluate(obs, det["actions"], det["extras"])
        torch.testing.assert_close(ev3["logprobs"], det["logprobs"], rtol=0, atol=1e-5)
    finally:
        policy.temperature = 1.0


def test_values_equal_prefix_only_pass_and_action_level_values():
    torch.manual_seed(0)
    p = TokenVLAPolicy(_cfg(value_head="last_token"), obs_dim=O, action_dim=D, num_values=C, image_size=16)
    obs = _obs(p, 2)
    out = p.act(obs)
    assert out["values"].shape == (2, C)
    torch.testing.assert_close(out["values"], p.values(obs), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="16x16"):
        p.act({**obs, "rgb": torch.zeros(2, 8, 8, 3, dtype=torch.uint8)})
    with pytest.raises(KeyError, match="rgb"):
        p.act({k: v for k, v in obs.items() if k != "rgb"})
    with pytest.raises(ValueError, match="num_values=2"):
        TokenVLAPolicy(_cfg(num_action_chunks=3), obs_dim=O, action_dim=D, num_values=2)


def test_evaluate_shape_errors(policy):
    obs = _obs(policy, 2)
    with pytest.raises(ValueError, match=r"expected \[N, 2, 3\]"):
        policy.evaluate(obs, torch.zeros(2, C, D + 1))
    with pytest.raises(ValueError, match=r"tokens \(2, 2, 2\)"):
        policy.evaluate(obs, torch.zeros(2, C, D), {"tokens": torch.zeros(2, C, 2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"expected \[N, 2, 3\]"):
        policy.sft_loss(obs, torch.zeros(2, C + 1, D))


# ----------------------------------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_same_actions_and_stats(tmp_path):
    torch.manual_seed(0)
    p = TokenVLAPolicy(_cfg(), obs_dim=O, action_dim=D, image_size=16)
    p.set_action_stats(*STATS)
    p.save_pretrained(tmp_path / "ckpt")
    assert read_action_stats(tmp_path / "ckpt") == {"q01": STATS[0].tolist(), "q99": STATS[1].tolist()}
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["family"] == "token_vla"
    q = TokenVLAPolicy.from_pretrained(tmp_path / "ckpt")
    torch.testing.assert_close(q.action_q01, STATS[0])
    torch.testing.assert_close(q.action_q99, STATS[1])
    obs = _obs(p, 4)
    assert torch.equal(q.tokenize(["push the cube"]), p.tokenize(["push the cube"]))
    torch.manual_seed(7)
    a = p.act(obs)
    torch.manual_seed(7)
    b = q.act(obs)
    for k in ("actions", "logprobs", "values"):
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(a["extras"]["tokens"], b["extras"]["tokens"])
    # through the registry: make_policy loads model_path (weights and stats)
    r = make_policy(_cfg(model_path=str(tmp_path / "ckpt")), obs_dim=O, action_dim=D, image_size=16, seed=123)
    torch.manual_seed(7)
    c = r.act(obs)
    assert torch.equal(a["actions"], c["actions"]) and torch.equal(a["logprobs"], c["logprobs"])


def test_registry_and_config_checks():
    assert isinstance(make_policy(_cfg(), obs_dim=O, action_dim=D, seed=0), TokenVLAPolicy)
    check_policy_config(_cfg())
    with pytest.raises(ConfigError, match="policy.action_bins"):
        check_policy_config(_cfg(action_bins=1))
    with pytest.raises(ConfigError, match="policy.preset"):
        check_policy_config(_cfg(preset="openvla_7b"))
    with pytest.raises(ConfigError, match="policy.sizes"):
        check_policy_config(_cfg(sizes={"expert_width": 8}))


# --------------------------------------------------------------------------------------------------------- SFT
def test_sft_loss_overfits_a_fixed_batch():
    torch.manual_seed(0)
    p = TokenVLAPolicy(_cfg(action_bins=32), obs_dim=O, action_dim=D)
    p.set_action_stats(*STATS)
    obs = _obs(p, 4, seed=5)
    g = torch.Generator().manual_seed(6)
    q01, q99 = STATS
    demo = q01 + (q99 - q01) * torch.rand(4, C, D, generator=g)
    opt = torch.optim.Adam(p.parameters(), lr=1e-2)
    first = p.sft_loss(obs, demo).item()
    for _ in range(40):
        loss = p.sft_loss(obs, demo)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.0 and loss.item() < 0.1, (first, loss.item())
    det = p.act(obs, deterministic=True)
    assert torch.equal(det["extras"]["tokens"], p.actions_to_bins(demo))
    assert ((det["actions"] - demo).abs() <= (q99 - q01) / 32 / 2 + 1e-6).all()


# ------------------------------------------------------------------------------------------- real-size preset
def test_openvla_oft_preset_on_meta_device():
    cfg = _cfg(preset="openvla_oft", num_action_chunks=8)
    with torch.device("meta"):
        p = TokenVLAPolicy(cfg, obs_dim=8, action_dim=7, image_size=224)
    n = sum(x.numel() for x in p.parameters())
    # Llama-2-7B without its LM head (6.61 B) + SigLIP-So400m (0.41 B) + heads; OpenVLA-7B is 7.54 B with
    # DINOv2-L (0.30 B) and the 32000-way LM head (0.13 B) that this approximation leaves out
    assert 6.9e9 < n < 7.2e9, n
    assert 6.5e9 < sum(x.numel() for x in p.prefix.lm.parameters()) < 6.7e9
    assert p.prefix.num_patches == 256 and p.action_queries.shape == (8 * 7, 4096)
    tiny = sum(x.numel() for x in TokenVLAPolicy(_cfg(), obs_dim=8, action_dim=7).parameters())
    assert tiny < 1e6


def test_policy_temperature_is_the_sampling_temperature_and_is_checked():
    """policy.temperature reaches the policy (act's sampling distribution, evaluate's log-probs); the argmax act is
    the same at any temperature; <= 0 is refused by the config check."""
    torch.manual_seed(0)
    hot = make_policy(_cfg(temperature=2.0), obs_dim=O, action_dim=D)
    cold = make_policy(_cfg(temperature=0.25), obs_dim=O, action_dim=D)
    cold.load_state_dict(hot.state_dict())
    assert (hot.temperature, cold.temperature) == (2.0, 0.25)
    obs = _obs(hot, 4)
    torch.testing.assert_close(hot.act(obs, deterministic=True)["actions"],
                               cold.act(obs, deterministic=True)["actions"])
    out = cold.act(obs)
    lp_hot = hot.evaluate(obs, out["actions"], out["extras"])["logprobs"]
    lp_cold = cold.evaluate(obs, out["actions"], out["extras"])["logprobs"]
    torch.testing.assert_close(lp_cold, out["logprobs"])  # ratio 1 at the rollout's own temperature
    assert not torch.allclose(lp_hot, lp_cold)
    with pytest.raises(ConfigError, match="policy.temperature"):
        check_config(Config(policy=_cfg(temperature=0.0)))
