"""LoRA, freeze list, gradient checkpointing and the sync state of the pi0 families (tasks/policies/pi0/lora.py), on a
tiny transformers PI0 model (Gemma 2 x 64, SigLIP 2 x 32 at 32 px, expert 2 x 32, chunk 4, dims 8: MACHINE.md)
wrapped with a value head outside the library's model, as the family's policy holds it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tasks.config.errors import ConfigError  # noqa: E402
from tasks.policies.pi0 import lora  # noqa: E402
from tasks.policies.pi0.configuration import PI0PolicyConfig  # noqa: E402
from tasks.policies.pi0.memory import check_training_keys  # noqa: E402

TARGETS = PI0PolicyConfig().lora_targets  # the default policy.lora_targets

B, CHUNK, DIM, PX, PATCH = 2, 4, 8, 32, 8


def tiny_config():
    return transformers.PI0Config(
        vlm_config={"model_type": "paligemma", "hidden_size": 64, "projection_dim": 64, "vocab_size": 300,
                    "image_token_index": 299,
                    "text_config": {"model_type": "gemma", "hidden_size": 64, "intermediate_size": 128,
                                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                                    "head_dim": 32, "vocab_size": 300},
                    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                                      "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": PATCH,
                                      "image_size": PX}},
        dit_config={"model_type": "gemma", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300},
        chunk_size=CHUNK, max_action_dim=DIM, max_state_dim=DIM)


class Wrapped(torch.nn.Module):
    """The family's shape: the library's model under `base`, an RL head outside it."""

    def __init__(self):
        super().__init__()
        self.base = transformers.PI0ForConditionalGeneration(tiny_config())
        self.value_head = torch.nn.Linear(DIM, 1)

    def loss(self, batch: dict) -> torch.Tensor:
        out = self.base(state=batch["state"], input_ids=batch["ids"], pixel_values=batch["px"],
                        pixel_attention_mask=batch["pmask"], attention_mask=torch.ones_like(batch["ids"]),
                        actions=batch["actions"], noise=batch["noise"], timestep=batch["t"])
        return out.loss + self.value_head(batch["state"]).pow(2).mean()


def make(seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    return Wrapped()


def batch(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    img = 299
    ids = torch.cat([torch.full((B, (PX // PATCH) ** 2), img), torch.randint(0, 200, (B, 5), generator=g)], 1)
    return {"state": torch.randn(B, DIM, generator=g), "ids": ids, "px": torch.randn(B, 1, 3, PX, PX, generator=g),
            "pmask": torch.ones(B, 1, dtype=torch.bool), "actions": torch.randn(B, CHUNK, DIM, generator=g),
            "noise": torch.randn(B, CHUNK, DIM, generator=g), "t": torch.rand(B, generator=g)}


def keys(**kw) -> PI0PolicyConfig:
    return PI0PolicyConfig(**kw)


def test_lora_adapts_only_the_gemma_projections_and_starts_as_the_base():
    pol, ref = make(), make()
    b = batch()
    names = lora.apply_lora(pol.base, rank=4, alpha=8, targets=TARGETS)
    # 2 Gemma + 2 expert layers x (q, k, v, o, gate, up, down); SigLIP's q/k/v_proj are not adapted
    assert len(names) == 4 * 7
    assert not any("vision_tower" in n for n in names)
    assert all(n.split(".")[1] in ("vlm", "dit") for n in names)
    # B = 0 at the start: the adapted model computes what the base does
    with torch.no_grad():
        assert torch.equal(pol.loss(b), ref.loss(b))


def test_lora_trains_only_adapters_and_heads_frozen_stay_bit_identical():
    pol = make()
    lora.configure_training(pol, pol.base, keys(lora_rank=4, lora_alpha=8))
    trainable = lora.trainable_names(pol)
    assert trainable and all(lora.is_adapter(n) or n.startswith("value_head.") for n in trainable)
    assert {"value_head.weight", "value_head.bias"} <= set(trainable)
    # adapter parameter count: sum over adapted Linear(in, out) of r * (in + out)
    adapted = [m for n, m in pol.base.named_modules() if n in set(lora.lora_target_names(pol.base, TARGETS))]
    expect = sum(4 * (m.in_features + m.out_features) for m in adapted)
    assert sum(p.numel() for n, p in pol.named_parameters() if lora.is_adapter(n)) == expect

    before = {k: v.clone() for k, v in pol.state_dict().items()}
    opt = torch.optim.Adam([p for p in pol.parameters() if p.requires_grad], lr=1e-2)
    for s in range(2):  # two steps: after the first, B != 0 and A receives gradient too
        opt.zero_grad()
        pol.loss(batch(s + 1)).backward()
        opt.step()
    after = pol.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    reached = {n for n, p in pol.named_parameters() if p.grad is not None}
    assert reached <= set(trainable) and changed == reached  # what the gradient reached moved, nothing else
    # the expert reads only the VLM layers' keys/values: the last VLM layer's q/o projections and MLP feed nothing,
    # so their adapters get no gradient; every other adapter and the head do
    dead = {n for n in trainable if ".language_model.layers.1." in n and not (".k_proj." in n or ".v_proj." in n)}
    assert changed == set(trainable) - dead and len(dead) == 5 * 2
    frozen = [k for k in after if k not in set(trainable)]
    assert frozen and all(torch.equal(after[k], before[k]) for k in frozen)


def test_freeze_list_full_finetuning():
    pol = make()
    tower = "base.model.vlm.vision_tower"
    lora.configure_training(pol, pol.base, keys(lora_rank=0, freeze=[tower]))
    unused = "base." + lora.UNUSED[0] + "."  # pi0's expert token embedding: never used, always frozen
    for n, p in pol.named_parameters():
        assert p.requires_grad == (not n.startswith((tower + ".", unused))), n
    with pytest.raises(ConfigError, match="policy.freeze"):
        lora.set_trainable(make(), make().base, lora=False, freeze=["base.no_such_module"])


def test_unknown_target_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="policy.lora_targets.*'qkv_proj' matches no Linear"):
        lora.apply_lora(make().base, rank=2, alpha=2, targets=["qkv_proj"])


@pytest.mark.parametrize("bad, key", [({"lora_rank": -1}, "policy.lora_rank"),
                                      ({"lora_rank": 4, "lora_alpha": 0}, "policy.lora_alpha"),
                                      ({"lora_rank": 4, "lora_targets": []}, "policy.lora_targets"),
                                      ({"freeze": [""]}, "policy.freeze")])
def test_check_training_keys(bad, key):
    with pytest.raises(ConfigError, match=key):
        check_training_keys(SimpleNamespace(policy=keys(**bad)))
    check_training_keys(SimpleNamespace(policy=keys(lora_rank=4)))


def test_gradient_checkpointing_keeps_the_prefix_cache_and_equals_plain_gradients():
    plain, ckpt = make(), make()
    assert lora.enable_checkpointing(ckpt.base) == 2 + 2 + 2  # Gemma, expert and SigLIP layers
    plain.train(), ckpt.train()
    b = batch()
    lp, lc = plain.loss(b), ckpt.loss(b)
    lp.backward(), lc.backward()
    assert torch.equal(lp, lc)
    gp, gc = dict(plain.named_parameters()), dict(ckpt.named_parameters())
    missing = [n for n, p in gp.items() if p.grad is not None and gc[n].grad is None]
    assert not missing
    for n, p in gp.items():
        if p.grad is not None:
            torch.testing.assert_close(gc[n].grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_transformers_own_checkpointing_breaks_pi0_training():
    """Why enable_checkpointing exists: transformers drops the cache the expert reads (module docstring). If this
    starts passing, the library fixed it and policy.gradient_checkpointing may use its own switch."""
    pol = make()
    pol.base.activation_checkpointing_enable()
    pol.train()
    with pytest.raises(AttributeError, match="get_seq_length"):
        pol.loss(batch())


def test_sync_state_is_the_trainable_tensors_and_loads_into_a_replica():
    actor = make()
    lora.configure_training(actor, actor.base, keys(lora_rank=4, lora_alpha=8))
    opt = torch.optim.Adam([p for p in actor.parameters() if p.requires_grad], lr=1e-2)
    for s in range(2):
        opt.zero_grad()
        actor.loss(batch(s + 1)).backward()
        opt.step()
    replica = make()  # the same frozen weights (its first full load), adapters at their start
    lora.configure_training(replica, replica.base, keys(lora_rank=4, lora_alpha=8))
    sync = lora.sync_state(actor)
    assert set(sync) == set(lora.trainable_names(actor))
    full = sum(v.numel() * v.element_size() for v in actor.state_dict().values())
    assert sum(v.numel() * v.element_size() for v in sync.values()) < full / 5
    lora.load_sync_state(replica, sync)
    a, r = actor.state_dict(), replica.state_dict()
    assert all(torch.equal(a[k], r[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(actor.loss(batch(7)), replica.loss(batch(7)))
    with pytest.raises(KeyError):
        lora.load_sync_state(make(), sync)  # no adapters there


def test_merged_state_dict_loads_into_the_plain_library_model():
    pol = make()
    lora.configure_training(pol, pol.base, keys(lora_rank=4, lora_alpha=8))
    with torch.no_grad():
        for n, p in pol.named_parameters():
            if lora.is_adapter(n):
                p.normal_(0, 0.05)  # non-zero B: the adapters change the output
    plain = transformers.PI0ForConditionalGeneration(tiny_config())
    plain.load_state_dict(lora.merged_state_dict(pol.base), strict=True)
    b = batch()
    kw = dict(state=b["state"], input_ids=b["ids"], pixel_values=b["px"], pixel_attention_mask=b["pmask"],
              attention_mask=torch.ones_like(b["ids"]), actions=b["actions"], noise=b["noise"], timestep=b["t"])
    with torch.no_grad():
        torch.testing.assert_close(plain(**kw).loss, pol.base(**kw).loss, rtol=1e-5, atol=1e-6)
        unmerged = transformers.PI0ForConditionalGeneration(tiny_config())
        unmerged.load_state_dict({k.replace(".base_layer", ""): v for k, v in pol.base.state_dict().items()
                                  if not lora.is_adapter(k)})
        assert not torch.allclose(unmerged(**kw).loss, pol.base(**kw).loss)  # the adapters matter here


# ---------------------------------------------------------------- through the family's policy (tasks.policies.pi0.model)
O, D, C, K, NB = 9, 7, 4, 4, 3


def _policy(family="pi0", seed=0, **kw):
    from tasks.config import family_class
    from tasks.policies import make_policy
    cfg = family_class("policy", family)(num_action_chunks=C, num_denoise_steps=K, **kw)
    return make_policy(cfg, obs_dim=O, action_dim=D, seed=seed, image_size=40)


def _obs(policy, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {"state": torch.randn(NB, O, generator=g),
            "rgb": torch.randint(0, 256, (NB, 40, 40, 3), generator=g, dtype=torch.uint8),
            "prompt": policy.tokenize(["push the cube", "pick up the red block", "open the drawer"])}


def _ppo_step(policy, seed=0):
    obs = _obs(policy, seed + 1)
    torch.manual_seed(seed)
    out = policy.act(obs)
    ev = policy.evaluate(obs, out["actions"], out["extras"])
    return obs, out, ev, (-(ev["logprobs"].sum()) + ev["values"].pow(2).mean())


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_family_policy_with_lora_updates_only_adapters_and_heads(family):
    policy = _policy(family, lora_rank=4, lora_alpha=8)
    trainable = set(lora.trainable_names(policy))
    assert trainable and all(lora.is_adapter(n) or n.startswith("value_head.") for n in trainable)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=1e-3)
    for s in range(2):
        opt.zero_grad()
        _ppo_step(policy, s)[-1].backward()
        opt.step()
    after = policy.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and changed <= trainable
    assert any(k.startswith("value_head.") for k in changed) and any(".vlm." in k for k in changed)
    dense = [p for n, p in policy.named_parameters() if ".dit." in n and n.endswith(".dense.weight")]
    if family == "pi0":
        assert any(".dit." in k for k in changed)
    else:  # pi05's adaptive RMSNorm `dense` starts at 0 (transformers' init): the expert's blocks are gated off in a
        # fresh model, so its adapters get no gradient while those (frozen) gates stay 0; a checkpoint's are not 0
        assert dense and all(torch.equal(p, torch.zeros_like(p)) for p in dense)
        assert not any(".dit." in k for k in changed)
    # a replica with the same frozen weights (same seed) takes the sync state and acts as the actor does
    replica = _policy(family, lora_rank=4, lora_alpha=8)
    lora.load_sync_state(replica, lora.sync_state(policy))
    obs, noise = _obs(policy, 9), torch.randn(NB, policy.T, policy.A)
    assert torch.equal(replica.act(obs, True, noise)["actions"], policy.act(obs, True, noise)["actions"])


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_family_export_with_lora_is_plain_transformers(family, tmp_path):
    from tasks.policies.pi0.library import model_class
    policy = _policy(family, lora_rank=4, lora_alpha=8)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)  # adapters that change the model
    policy.save_pretrained(tmp_path)
    plain = model_class(family).from_pretrained(str(tmp_path))  # no peft keys: loads as is (strict by default)
    assert not any("lora" in k or "base_layer" in k for k in plain.state_dict())
    back = type(policy).from_pretrained(tmp_path)  # LoRA again (the export's keys), fresh adapters on the merged base
    assert back.cfg.lora_rank == 4
    obs, noise = _obs(policy), torch.randn(NB, policy.T, policy.A)
    torch.testing.assert_close(back.act(obs, True, noise)["actions"], policy.act(obs, True, noise)["actions"],
                               rtol=1e-4, atol=1e-5)


def test_family_gradient_checkpointing_equals_plain_gradients_over_k_expert_passes():
    plain, ckpt = _policy("pi0"), _policy("pi0", gradient_checkpointing=True)
    plain.train(), ckpt.train()
    lp, lc = _ppo_step(plain)[-1], _ppo_step(ckpt)[-1]
    lp.backward(), lc.backward()
    assert torch.equal(lp, lc)
    gc = dict(ckpt.named_parameters())
    n_grads = 0
    for n, p in plain.named_parameters():
        assert (p.grad is None) == (gc[n].grad is None), n
        if p.grad is not None:
            n_grads += 1
            torch.testing.assert_close(gc[n].grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert n_grads > 20


def test_family_freeze_list_names_the_policy_parameters():
    policy = _policy("pi0", freeze=["hf.model.vlm.vision_tower"])
    unused = "hf." + lora.UNUSED[0] + "."  # pi0's expert token embedding: never used, always frozen
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("hf.model.vlm.vision_tower.", unused)) for n in frozen)
    assert frozen == {n for n, _ in policy.named_parameters() if n.startswith(("hf.model.vlm.vision_tower.", unused))}


def test_fsdp_units_are_the_decoder_layers():
    policy = _policy("pi0")
    units = policy.fsdp_units()
    assert len(units) == 2 + 2 + 2  # SigLIP, Gemma, expert layers of the tiny preset
    assert {type(u).__name__ for u in units} == {"SiglipEncoderLayer", "GemmaDecoderLayer"}


def test_lora_keys_compose_and_are_inert_without_a_rank():
    from pipelines.config import load_config
    base = ["policy=pi0_tiny", "env.obs_mode=rgb"]
    with pytest.raises(ConfigError, match=r"policy.lora_alpha=32.0: .*policy.lora_rank=0"):
        load_config([*base, "policy.lora_alpha=32"], components=False)
    cfg, _ = load_config([*base, "policy.lora_rank=8", "policy.lora_alpha=32", "policy.lora_targets=[dit.*_proj]",
                          "policy.freeze=[hf.model.vlm.vision_tower]", "policy.gradient_checkpointing=true"],
                         components=False)
    p = cfg.policy
    assert (p.lora_rank, p.lora_alpha, list(p.lora_targets), list(p.freeze), p.gradient_checkpointing) == \
           (8, 32.0, ["dit.*_proj"], ["hf.model.vlm.vision_tower"], True)
    with pytest.raises(ConfigError, match="policy.lora_rank"):
        load_config([*base, "policy.lora_rank=-1"], components=False)


@pytest.mark.parametrize("override, key, match", [
    ("policy.freeze=[nonexistent.module]", "policy.freeze", "no parameter of the pi0 policy is under 'nonexistent"),
    ("policy.freeze=[hf.model.vlm.no_such]", "policy.freeze", "under 'hf.model.vlm.no_such'"),
    ("policy.lora_targets=[nope]", "policy.lora_targets", "'nope' matches no Linear module"),
])
def test_module_names_are_checked_offline_before_anything_starts(override, key, match):
    """A freeze prefix or LoRA target naming no module of the model is refused by the offline checks (validate and
    run alike, before a worker starts), on the library model built on the meta device; names that exist pass."""
    from pipelines.config import load_config
    base = ["conf=smoke", "env=pushcube_vla", "policy=pi0_tiny", "policy.lora_rank=4"]
    with pytest.raises(ConfigError, match=match) as err:
        load_config([*base, override])
    assert err.value.key == key
    cfg, _ = load_config([*base, "policy.freeze=[hf.model.vlm, value_head]", "policy.lora_targets=[q_proj]"])
    assert list(cfg.policy.freeze) == ["hf.model.vlm", "value_head"]
