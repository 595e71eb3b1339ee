"""The pi0 / pi05 families: transformers' models behind the Policy protocol.

Parity with the library (the deterministic path is `sample_actions`, the SFT loss is the forward's own loss),
Flow-SDE at noise level 0 is the ODE, ratio = 1 with unchanged parameters, checkpoints both ways with plain
transformers, the processor's prompts (image tokens per camera, pi05's discretised state), the presets.
"""
from __future__ import annotations

import json

import pytest
import torch

from tasks.config import ConfigError, family_class
from tasks.policies import make_policy

FAMILIES = ("pi0", "pi05")
O, D, C, K, B = 9, 7, 4, 4, 3


def _cfg(family, **kw):
    kw = {"num_action_chunks": C, "num_denoise_steps": K, **kw}
    return family_class("policy", family)(**kw)


def _policy(family, seed=0, image_size=40, **kw):
    return make_policy(_cfg(family, **kw), obs_dim=O, action_dim=D, seed=seed, image_size=image_size)


def _obs(policy, batch=B, seed=1, image_size=40, wrist=False):
    g = torch.Generator().manual_seed(seed)
    obs = {"state": torch.randn(batch, O, generator=g),
           "rgb": torch.randint(0, 256, (batch, image_size, image_size, 3), generator=g, dtype=torch.uint8),
           "prompt": policy.tokenize(["push the cube to the goal", "pick up the red block"] * batch)[:batch]}
    if wrist:
        obs["wrist_rgb"] = torch.randint(0, 256, (batch, image_size, image_size, 3), generator=g, dtype=torch.uint8)
    return obs


def _library_kwargs(policy, inp):
    kw = {k: inp[k] for k in ("input_ids", "pixel_values", "attention_mask", "pixel_attention_mask")}
    if policy.state_input:
        kw["state"] = inp["state"]
    return kw


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("wrist", [False, True])
def test_ode_equals_the_library_sample_actions(family, wrist):
    policy = _policy(family)
    obs = _obs(policy, wrist=wrist)
    noise = torch.randn(B, policy.T, policy.A, generator=torch.Generator().manual_seed(3))
    ours = policy.act(obs, deterministic=True, noise=noise)
    inp = policy._inputs(obs)
    ref = policy.hf.sample_actions(noise=noise, num_steps=K, **_library_kwargs(policy, inp))
    torch.testing.assert_close(ours["extras"]["chain"][:, -1], ref, rtol=0, atol=1e-6)
    # the env gets the first C actions' first D dims, un-normalised with the processor's (identity) statistics
    torch.testing.assert_close(ours["actions"], ref[:, :C, :D], rtol=0, atol=1e-6)
    assert torch.equal(ours["logprobs"], torch.zeros(B, C, D))


@pytest.mark.parametrize("family", FAMILIES)
def test_flow_sde_at_noise_level_zero_is_the_ode(family):
    policy = _policy(family, noise_level=0.0)
    obs = _obs(policy)
    noise = torch.randn(B, policy.T, policy.A)
    det = policy.act(obs, deterministic=True, noise=noise)
    sde = policy.act(obs, deterministic=False, noise=noise)
    assert (sde["extras"]["denoise_idx"] >= 0).all()
    assert torch.equal(sde["extras"]["chain"], det["extras"]["chain"])


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_loss_is_the_library_forward_loss(family):
    policy = _policy(family)
    obs = _obs(policy)
    actions = torch.randn(B, C, D)
    torch.manual_seed(5)
    ours = policy.sft_loss(obs, actions)
    inp = policy._inputs(obs)
    padded = torch.nn.functional.pad(actions, (0, policy.A - D))  # identity statistics: the actions as they are
    torch.manual_seed(5)
    ref = policy.hf(actions=padded, **_library_kwargs(policy, inp)).loss
    assert torch.equal(ours, ref)
    ours.backward()
    assert policy.hf.action_out_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_sft_loss_ignores_masked_samples_and_equals_the_plain_loss_when_all_set(family):
    policy = _policy(family)
    obs, actions = _obs(policy), torch.randn(B, C, D)

    def loss(a, m):
        torch.manual_seed(7)  # the same time and noise draws in each call
        with torch.no_grad():
            return policy.sft_loss(obs, a, m).item()

    full = torch.ones(B, C, dtype=torch.bool)
    assert loss(actions, full) == pytest.approx(loss(actions, None), rel=1e-6)
    mask = full.clone()
    mask[1] = False
    wild = actions.clone()
    wild[1] = 1e4  # a masked-out sample may hold anything
    assert loss(wild, mask) == pytest.approx(loss(actions, mask), rel=1e-6)
    assert loss(actions, torch.zeros(B, C, dtype=torch.bool)) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["flow_sde", "flow_noise"])
def test_ratio_is_one_with_unchanged_parameters(family, method):
    policy = _policy(family, noise_method=method)
    obs = _obs(policy)
    torch.manual_seed(0)
    out = policy.act(obs)
    ev = policy.evaluate(obs, out["actions"], out["extras"])
    assert torch.equal(ev["logprobs"], out["logprobs"])
    assert torch.equal(ev["values"], out["values"])
    assert (out["logprobs"] != 0).any()
    ev["logprobs"].sum().backward()  # differentiable down to the library's weights
    assert policy.hf.action_out_proj.weight.grad.abs().sum() > 0
    if method == "flow_noise":
        assert policy.noise_head.mlp[0].weight.grad is not None
        assert (out["extras"]["denoise_idx"] == -1).all()


def test_the_value_head_reads_the_prefix_only():
    """V(s) does not depend on the sampler's draws: the same obs gives the same values in act and values()."""
    policy = _policy("pi0")
    obs = _obs(policy)
    a, b = policy.act(obs), policy.act(obs)
    assert torch.equal(a["values"], b["values"])
    assert torch.equal(policy.values(obs), a["values"])


def test_two_cameras_give_two_image_blocks_and_a_mask():
    policy = _policy("pi0")
    inp = policy._inputs(_obs(policy, wrist=True))
    n = policy.processor.image_seq_length
    assert inp["pixel_values"].shape == (B, 2, 3, 32, 32)  # resized to the tiny vision tower's 32 px
    assert inp["pixel_attention_mask"].tolist() == [[True, True]] * B
    assert ((inp["input_ids"] == policy.processor.image_token_id).sum(1) == 2 * n).all()
    assert inp["input_ids"].shape[1] == 2 * n + policy.cfg.max_prompt_len


def test_pi05_writes_the_discretised_state_into_the_prompt():
    policy = _policy("pi05")
    obs = _obs(policy, batch=1)
    obs["state"] = torch.zeros(1, O)  # normalised 0 falls in bin 128 of 256 bins over [-1, 1)
    ids = policy._inputs(obs)["input_ids"][0]
    text = policy.processor.tokenizer.decode(ids[ids != policy.processor.image_token_id], skip_special_tokens=True)
    assert text == "Task: push the cube to the goal, State: " + " ".join(["128"] * O) + ";\nAction: "


def test_tiny_tokenizer_is_paligemma_style():
    policy = _policy("pi0")
    tok = policy.processor.tokenizer
    assert [tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert policy.processor.image_token_id == 260  # after the 4 specials and 256 byte symbols
    assert len(tok) == 260 + 1 + 1024 + 128  # + <image>, <loc0000..1023>, <seg000..127>
    assert policy.hf.config.vlm_config.text_config.vocab_size == len(tok)
    text = "Push the cube, 3 cm! ü"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_plain_transformers_and_back(family, tmp_path):
    from tasks.policies.pi0.library import model_class
    policy = _policy(family, noise_method="flow_noise")
    with torch.no_grad():
        policy.noise_head.mlp[-1].bias.fill_(0.3)  # a head that differs from its initialisation
    policy.save_pretrained(tmp_path)
    plain = model_class(family).from_pretrained(str(tmp_path))
    for k, v in policy.hf.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    back = type(policy).from_pretrained(tmp_path)
    obs = _obs(policy)
    noise = torch.randn(B, policy.T, policy.A)
    assert torch.equal(back.act(obs, True, noise)["actions"], policy.act(obs, True, noise)["actions"])
    assert torch.equal(back.noise_head.mlp[-1].bias, policy.noise_head.mlp[-1].bias)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["model_type"] == family and meta["family"] == family and meta["obs_dim"] == O
    # what plain transformers' processor loading reads (its PI0ImageProcessor needs torchvision: the next test)
    from transformers import AutoTokenizer
    proc = json.loads((tmp_path / "processor_config.json").read_text())
    assert proc["processor_class"] == type(policy.processor).__name__  # PI0Processor / PI05Processor
    assert proc["image_processor"]["image_processor_type"] == "PI0ImageProcessor"
    assert proc["state_mean"] == [0.0] * O and proc["actions_std"] == [1.0] * D
    text = "<image><bos>push the cube\n"
    assert AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"] == \
        policy.processor.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_transformers_processor_reads_the_export(family, tmp_path):
    pytest.importorskip("torchvision")  # transformers' PI0ImageProcessor needs it; dagrl does not install it
    from tasks.policies.pi0.processor import processor_class
    policy = _policy(family)
    policy.save_pretrained(tmp_path)
    proc = processor_class(family).from_pretrained(str(tmp_path))
    assert proc.state_mean == policy.processor.state_mean and proc.image_token_id == policy.processor.image_token_id


@pytest.mark.parametrize("family", FAMILIES)
def test_a_plain_transformers_directory_is_a_model_path(family, tmp_path):
    """A directory written by transformers alone (no dagrl keys, no heads file) loads unchanged: its weights,
    its processor's statistics; the RL heads start fresh. Its chunk (C + 2 actions) is longer than the env
    executes (C): the first C are the env's."""
    from tasks.policies.pi0.library import model_class, preset_config
    from tasks.policies.pi0.processor import new_processor
    proc = new_processor(family, image_size=32, patch_size=8, obs_dim=O, action_dim=D, max_state_dim=64,
                         chunk_size=C)
    proc.actions_mean, proc.actions_std = [0.5] * D, [2.0] * D
    torch.manual_seed(7)
    lib = model_class(family)(preset_config(family, "tiny", chunk_size=C + 2, num_steps=K,
                                            vocab_size=len(proc.tokenizer), image_token_id=proc.image_token_id))
    lib.save_pretrained(str(tmp_path))
    proc.save_pretrained(str(tmp_path))
    policy = make_policy(_cfg(family, model_path=str(tmp_path)), obs_dim=O, action_dim=D, seed=0, image_size=40)
    for k, v in lib.state_dict().items():
        assert torch.equal(policy.hf.state_dict()[k], v), k
    obs = _obs(policy)
    noise = torch.randn(B, C + 2, policy.A)
    out = policy.act(obs, deterministic=True, noise=noise)
    ref = lib.sample_actions(noise=noise, num_steps=K, **_library_kwargs(policy, policy._inputs(obs)))
    torch.testing.assert_close(out["actions"], ref[:, :C, :D] * 2.0 + 0.5, rtol=0, atol=1e-5)  # the checkpoint's stats
    assert out["extras"]["chain"].shape == (B, K + 1, C + 2, policy.A)
    torch.manual_seed(0)
    sampled = policy.act(obs)
    ev = policy.evaluate(obs, sampled["actions"], sampled["extras"])
    assert torch.equal(ev["logprobs"], sampled["logprobs"]) and ev["logprobs"].shape == (B, C, D)
    assert policy.sft_loss(obs, torch.randn(B, C, D)).item() > 0  # the first C actions of the chunk count
    with pytest.raises(ConfigError, match="num_action_chunks"):  # more actions than the model predicts
        make_policy(_cfg(family, model_path=str(tmp_path), num_action_chunks=C + 3), obs_dim=O, action_dim=D,
                    image_size=40)
    with pytest.raises(ConfigError, match="statistics have 7 dims"):
        make_policy(_cfg(family, model_path=str(tmp_path)), obs_dim=O, action_dim=D + 1, image_size=40)


@pytest.mark.parametrize("family,billions", [("pi0", 3.501), ("pi05", 3.353)])
def test_base_preset_is_the_published_size(family, billions):
    """policy.preset=base is transformers' default config (lerobot/pi0_base's layout); the whole policy builds on the
    meta device (offline checks): the library's parameters are the published count, the RL heads come on top."""
    from tasks.policies import policy_class
    cfg = _cfg(family, preset="base", num_action_chunks=5, num_denoise_steps=10)
    with torch.device("meta"):
        policy = policy_class(family)(cfg, O, D, 1, image_size=128)
    assert round(sum(p.numel() for p in policy.hf.parameters()) / 1e9, 3) == billions
    assert (policy.T, policy.A, policy.processor.image_seq_length) == (50, 32, 256)  # 224 px / 14 px patches
    assert sum(p.numel() for p in policy.parameters()) > sum(p.numel() for p in policy.hf.parameters())


def test_state_only_env_is_refused():
    with pytest.raises(ConfigError, match="env.obs_mode"):
        make_policy(_cfg("pi0"), obs_dim=O, action_dim=D, image_size=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_longer_than_max_prompt_len_is_refused_not_cut(family):
    """pi05's state and "Action: " come last: a truncated prompt would drop them silently."""
    policy = _policy(family, max_prompt_len=12)
    obs = _obs(policy)  # "push the cube to the goal": 25 bytes + BOS + "\n" > 12 (pi0); pi05 adds the state
    with pytest.raises(ConfigError, match="policy.max_prompt_len"):
        policy.act(obs)
    short = _obs(policy, batch=1)
    short["prompt"] = policy.tokenize(["go"])
    if family == "pi0":  # BOS + "go" + "\n" fits
        assert policy.act(short)["actions"].shape == (1, C, D)


@pytest.mark.parametrize("overrides,key", [
    (["policy.preset=huge"], "policy.preset"),
    (["env=pushcube"], "env.obs_mode"),  # a state-only env: pi0 reads camera images
    (["policy.noise_level=0.3"], "policy.noise_level"),  # pi0_tiny samples with flow_noise: the SDE's level is inert
    (["policy.noise_method=flow_sde", "policy.noise_std_max=0.5"], "policy.noise_std_max"),
])
def test_the_config_refuses_what_does_nothing_or_cannot_work(overrides, key, tmp_path):
    from pipelines.config import load_config
    for preset in ("pi0_tiny", "pi05_tiny"):
        with pytest.raises(ConfigError) as err:
            load_config(["env=pushcube_vla", f"policy={preset}", *overrides, f"run_root={tmp_path}"],
                        components=False)
        assert err.value.key == key, str(err.value)
