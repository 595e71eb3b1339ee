"""The offline memory plan of the pi0 families (tasks/policies/pi0/memory.py): its terms on hand-computable sizes,
its parameter counts against real modules, its activation formula against what autograd saves, and the family
check's refusal / acceptance against cluster.gpu_memory_gib."""
from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from tasks.config import ConfigError  # noqa: E402
from tasks.config.registry import family_class  # noqa: E402
from tasks.config.schema import AlgorithmConfig, Config  # noqa: E402
from tasks.policies.pi0 import library, lora, memory  # noqa: E402
from tasks.policies.pi0.configuration import PI0PolicyConfig  # noqa: E402

GIB = 2**30
TARGETS = PI0PolicyConfig().lora_targets


def tiny(family="pi0"):
    return library.preset_config(family, "tiny", chunk_size=4, num_steps=4)


def test_gemma_and_siglip_layer_counts_by_hand():
    t, v = tiny().vlm_config.text_config, tiny().vlm_config.vision_config
    # Gemma 64 wide, 2 heads x 32, 1 kv head, MLP 128: 4*64 + 3*2*32 + 3*1*32 + 4*128
    assert memory.gemma_layer_elems(t) == 256 + 192 + 96 + 512
    # SigLIP 32 wide, MLP 64: 8*32 + 2*64
    assert memory.siglip_layer_elems(v) == 256 + 128


def test_activation_bytes_by_hand_with_and_without_checkpointing():
    c = tiny()  # SigLIP 2 x 32 (16 tokens a camera), Gemma 2 x 64, expert 2 x 32 (head dim 32, 2 heads, 1 kv, MLP 64)
    expert = 4 * 32 + 3 * 2 * 32 + 3 * 1 * 32 + 4 * 64
    cams, prompt, passes = 2, 5, 3
    sig_tok, vlm_tok, exp_tok = cams * 16, cams * 16 + prompt, passes * (4 + 1)  # pi0: the chunk + a state token
    full = 4 * (2 * sig_tok * 384 + 2 * vlm_tok * 1056 + 2 * exp_tok * expert)
    kw = dict(num_cameras=cams, prompt_len=prompt, expert_passes=passes, elem_bytes=4)
    assert memory.activation_bytes(c, checkpointing=False, **kw) == full
    kept = 2 * sig_tok * 32 + 2 * vlm_tok * 64 + 2 * exp_tok * 32
    replay = max(sig_tok * 384, vlm_tok * 1056, exp_tok * expert)
    assert memory.activation_bytes(c, checkpointing=True, **kw) == 4 * (kept + replay)
    # pi05 has no state token: the expert sees the chunk only
    c5 = tiny("pi05")
    e5 = memory.activation_bytes(c5, checkpointing=False, **kw) - memory.activation_bytes(
        c5, checkpointing=False, **dict(kw, expert_passes=0))
    assert e5 == 4 * 2 * passes * 4 * memory.gemma_layer_elems(c5.dit_config)


def test_model_shape_counts_equal_the_real_modules():
    c = tiny()
    torch.manual_seed(0)
    real = transformers.PI0ForConditionalGeneration(c)
    shape = memory.model_shape(c, num_cameras=1, prompt_len=4, expert_passes=1, elem_bytes=4, checkpointing=False)
    assert shape.params == sum(p.numel() for p in real.parameters())
    # full fine-tuning trains all but the expert's token embedding, which the forward never uses (lora.UNUSED)
    assert shape.trainable == shape.params - real.model.dit.embed_tokens.weight.numel()
    layer = real.model.vlm.language_model.layers[0]
    assert shape.largest_layer == sum(p.numel() for p in layer.parameters())  # the Gemma layer is the widest here
    in_layers = {id(p) for m in real.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp") for p in m.parameters()}
    assert shape.outside_layers == sum(p.numel() for p in real.parameters() if id(p) not in in_layers)
    lo = memory.model_shape(c, lora_rank=4, lora_targets=TARGETS, heads=9, num_cameras=1, prompt_len=4,
                            expert_passes=1, elem_bytes=4, checkpointing=False)
    lora.apply_lora(real, rank=4, alpha=8, targets=TARGETS)  # the adapters peft really makes
    assert lo.trainable == sum(p.numel() for n, p in real.named_parameters() if lora.is_adapter(n)) + 9
    assert lo.params == shape.params + 9


@pytest.mark.parametrize("family, billions", [("pi0", 3.501), ("pi05", 3.353)])
def test_base_presets_parameter_counts_on_the_meta_device(family, billions):
    c = library.preset_config(family, "base", chunk_size=50, num_steps=4)
    shape = memory.model_shape(c, num_cameras=2, prompt_len=48, expert_passes=1, elem_bytes=2, checkpointing=False)
    assert round(shape.params / 1e9, 3) == billions


def test_activation_formula_against_what_autograd_saves_for_base():
    """The formula counts the tensors autograd keeps; measured with saved_tensors_hooks on the meta device (float32,
    base pi0, 2 cameras, 48 prompt tokens, one expert pass; weights and their transposes excluded by storage). The
    meta device's math SDPA also keeps the S x S scores, which the formula leaves out (flash / efficient kernels keep
    none), so the measurement is larger by those."""
    c = library.preset_config("pi0", "base", chunk_size=50, num_steps=4)
    with torch.device("meta"):
        m = transformers.PI0ForConditionalGeneration(c)
    m.to("meta").train()  # a buffer the library's init may have recomputed on the CPU
    weights = {p.untyped_storage()._cdata for p in m.parameters()}
    saved: dict[int, int] = {}
    alive = []  # every saved tensor kept referenced: a freed storage's address could be reused and counted once

    def pack(t):
        if t.is_floating_point() and t.untyped_storage()._cdata not in weights:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            alive.append(t)
        return t

    cams, prompt, img = 2, 48, (224 // 14) ** 2
    with torch.device("meta"):
        ids = torch.cat([torch.full((1, cams * img), c.vlm_config.image_token_id),
                         torch.zeros((1, prompt), dtype=torch.long)], 1)
        kw = dict(state=torch.zeros(1, 32), input_ids=ids, pixel_values=torch.zeros(1, cams, 3, 224, 224),
                  pixel_attention_mask=torch.ones(1, cams, dtype=torch.bool), attention_mask=torch.ones_like(ids),
                  actions=torch.zeros(1, 50, 32), noise=torch.zeros(1, 50, 32), timestep=torch.zeros(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(**kw)
    scores = 4 * (27 * 16 * cams * img ** 2 + 18 * 8 * (cams * img + prompt) ** 2)  # SigLIP + Gemma S x S, fp32
    est = memory.activation_bytes(c, num_cameras=cams, prompt_len=prompt, expert_passes=1, elem_bytes=4,
                                  checkpointing=False)
    measured = sum(saved.values())
    assert 0.85 < (measured - scores) / est < 1.15, (measured / GIB, scores / GIB, est / GIB)


def test_plan_terms_by_hand():
    s = memory.ModelShape(params=1000, trainable=100, largest_layer=50, outside_layers=200, act_bytes=10,
                          act_bytes_ckpt=3)
    p = memory.plan_memory(s, ranks=2, micro_batch=4, checkpointing=False, replica_bytes=2, offload=False,
                           autocast=True)
    assert (p.weights, p.gathered, p.grads, p.optimizer, p.activations, p.casts, p.replica) == \
           (2000, 4 * (100 + 200), 200, 400, 40, 2000, 2000)
    assert p.total == 2000 + 1200 + 200 + 400 + 40 + 2000 + 2000 + memory.RESERVE_BYTES
    q = memory.plan_memory(s, ranks=1, micro_batch=4, checkpointing=True, replica_bytes=2, offload=True,
                           autocast=False)
    assert (q.weights, q.gathered, q.grads, q.optimizer, q.activations, q.casts, q.replica) == \
           (4000, 0, 400, 800, 12, 0, 0)


@pytest.mark.parametrize("placement, shares", [({"actor": "", "env": "", "rollout": ""}, True),
                                               ({"actor": "0-1", "rollout": "2-3"}, False),
                                               ({"actor": "0-1", "rollout": "1,3"}, True),
                                               ({"actor,env,rollout": "all"}, True),
                                               ({"actor": "", "rollout": "1"}, False)])
def test_replica_shares_actor_gpu(placement, shares):
    assert memory.replica_shares_actor_gpu(placement) is shares


def base_config(gib, family="pi0", **policy) -> Config:
    cluster = family_class("cluster", "local")
    return Config(policy=family_class("policy", family)(preset="base", dtype="bfloat16", **policy),
                  algorithm=AlgorithmConfig(num_minibatches=200), cluster=cluster(gpu_memory_gib=gib))


def _apply(cfg: Config, fix: str) -> Config:
    """`cfg` with the first `section.key=value` of a fix set."""
    key, val = re.match(r"(\S+)=(\S+)", fix).groups()
    section, name = key.split(".")
    old = getattr(getattr(cfg, section), name)
    val = (val == "true") if isinstance(old, bool) else type(old)(val) if old is not None else int(val)
    return replace(cfg, **{section: replace(getattr(cfg, section), **{name: val})})


def test_base_full_finetuning_on_one_80_gib_gpu_is_refused_with_the_number_and_fixes_that_work():
    cfg = base_config(80)
    plan = memory.config_plan(cfg)
    assert plan.total > 80 * GIB
    with pytest.raises(ConfigError) as e:
        memory.check_memory_plan(cfg)
    msg = str(e.value)
    assert msg.startswith("cluster.gpu_memory_gib=80") and f"{plan.total / GIB:.1f} GiB per GPU" in msg
    assert "fixes that fit alone" in msg
    fixes = re.split(r"; ", msg.split("fixes that fit alone: ")[1])
    named = {f.split("=")[0] for f in fixes}
    assert {"algorithm.num_actor_ranks", "policy.lora_rank", "policy.gradient_checkpointing",
            "algorithm.micro_batch_size", "algorithm.offload"} <= named  # micro-batches: the same update
    for fix in fixes:  # every fix offered passes the check when applied
        memory.check_memory_plan(_apply(cfg, fix))


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_base_accepted_with_lora_or_more_ranks_or_a_bigger_gpu(family):
    memory.check_memory_plan(base_config(80, family, lora_rank=16))
    more = base_config(80, family)
    memory.check_memory_plan(replace(more, algorithm=replace(more.algorithm, num_actor_ranks=2)))
    memory.check_memory_plan(base_config(140, family))  # an H200
    memory.check_memory_plan(base_config(None, family))  # not declared: not checked


@pytest.mark.parametrize("family, kw", [("pi0", {}), ("pi05", {}), ("pi0", {"freeze": ["hf.model.vlm.vision_tower"]}),
                                        ("pi05", {"freeze": ["hf.model.vlm", "value_head"]}),
                                        ("pi0", {"lora_rank": 4, "freeze": ["hf.model.dit"]})])
def test_grads_and_adam_count_what_the_built_policy_trains(family, kw):
    """The plan's grads (4 T) and Adam states (8 T) count the library model's parameters that the built policy
    leaves trainable (requires_grad after tasks.policies.pi0.lora.configure_training: `policy.freeze`'s prefixes,
    LoRA's frozen base, pi0's never-used expert embedding out); its weights (4 P) every base parameter."""
    from tasks.policies import make_policy
    p = family_class("policy", family)(preset="tiny", num_action_chunks=4, num_denoise_steps=2, **kw)
    policy = make_policy(p, obs_dim=9, action_dim=7, image_size=32)
    T = sum(q.numel() for q in policy.hf.parameters() if q.requires_grad)
    P = sum(q.numel() for n, q in policy.hf.named_parameters() if not lora.is_adapter(n))
    plan = memory.config_plan(Config(policy=p))
    assert (plan.grads, plan.optimizer, plan.weights) == (4 * T, 8 * T, 4 * P)
    if not kw:  # full fine-tuning: everything but pi0's expert token embedding (pi05's expert has none)
        unused = sum(q.numel() for q in lora.unused_parameters(policy.hf))
        assert T == P - unused and (unused > 0) == (family == "pi0")


def test_a_freeze_list_lowers_the_base_plan_by_the_frozen_parameters_grads_and_adam():
    """pi0 base: freezing the vision tower takes its parameters' 4 + 8 bytes each (grads, Adam) off one rank's plan;
    the expert embedding (257,152 x 1,024) is never counted as trainable."""
    full = memory.config_plan(base_config(None))
    frozen = memory.config_plan(base_config(None, freeze=["hf.model.vlm.vision_tower"]))
    with torch.device("meta"):
        hf = transformers.PI0ForConditionalGeneration(library.preset_config("pi0", "base", chunk_size=50, num_steps=4))
    tower = sum(q.numel() for q in hf.model.vlm.vision_tower.parameters())
    P = sum(q.numel() for q in hf.parameters())
    assert full.grads == 4 * (P - 257_152 * 1_024)
    assert (full.grads - frozen.grads, full.optimizer - frozen.optimizer) == (4 * tower, 8 * tower)
    assert full.weights == frozen.weights == 4 * P


def test_no_single_fix_fits_says_so():
    with pytest.raises(ConfigError, match=r"no single fix fits; combine them .*policy.lora_rank=16 -> "):
        memory.check_memory_plan(base_config(16))


def test_the_family_registers_the_rule():
    from tasks.config.registry import family_checks
    assert memory.check_memory_plan in family_checks("policy", "pi0")
    assert memory.check_training_keys in family_checks("policy", "pi0")


def test_load_config_refuses_base_on_a_declared_gpu_and_every_fix_offered_passes():
    """Through THE check path (pipelines.config.load_config, as pipelines.validate runs it): the family's rule, no
    pipelines code that knows the family; each fix the message offers, given as a command-line override, passes."""
    from pipelines.config import load_config
    base = ["policy=pi0_base", "env.obs_mode=rgb", "cluster.gpu_memory_gib=80", "algorithm.num_minibatches=200"]
    with pytest.raises(ConfigError, match=r"cluster.gpu_memory_gib=80.* GiB per GPU .*fixes that fit alone: ") as e:
        load_config(base, components=False)
    fixes = str(e.value).split("fixes that fit alone: ")[1].split("; ")
    assert len(fixes) >= 2
    for fix in fixes:
        override = fix.split(" ")[0]  # "key=value"
        cfg, _ = load_config([*base, override], components=False)
        assert memory.config_plan(cfg).total <= 80 * GIB
