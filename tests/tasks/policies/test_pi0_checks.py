"""The offline checks of the pi0 / pi05 families (tasks/policies/pi0/checks.py, names.py, processor.longest_prompt)
that refuse before any worker starts what the policy would refuse once running: a `policy.max_prompt_len` shorter
than the prompt the processor builds for the env's tasks (pi05: with the discretised state), and `policy.freeze` /
`algorithm.lr_scale` prefixes that name no parameter (the names on the meta device equal the built policy's)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from tasks.config import ConfigError, family_class  # noqa: E402
from tasks.policies import make_policy  # noqa: E402
from tasks.policies.pi0.processor import longest_prompt  # noqa: E402

O, D = 35, 8  # PushCube's state and action lengths
TEXTS = ["push the cube", "put both the alphabet soup and the tomato sauce in the basket"]


def _policy(family, **kw):
    cfg = family_class("policy", family)(num_action_chunks=4, num_denoise_steps=2, **kw)
    return make_policy(cfg, obs_dim=O, action_dim=D, image_size=32)


def _obs(policy, text, state):
    return {"state": torch.full((1, O), state), "rgb": torch.zeros(1, 32, 32, 3, dtype=torch.uint8),
            "prompt": policy.tokenize([text])}


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_the_offline_count_is_the_length_the_policy_needs(family):
    """The count is the prompt's tokens after the image tokens, by its format (the tiny tokenizer spends one token a
    byte): pi0 "<bos>TEXT\\n", pi05 "<bos>Task: TEXT, State: B B ...;\\nAction: " with every dimension at a
    three-digit bin (the most bytes a bin takes). The policy builds its inputs at that max_prompt_len and refuses one
    fewer (policy.max_prompt_len) for that text and state."""
    policy = _policy(family)
    need, text = longest_prompt(policy.processor, TEXTS, num_cameras=1, state_dim=O)
    assert text == TEXTS[1]
    if family == "pi0":
        assert need == 1 + len(text) + 1
    else:
        assert need == 1 + len(f"Task: {text}, State: " + " ".join(["100"] * O) + ";\nAction: ")
    obs = _obs(policy, text, 0.9)  # identity statistics: bin floor((0.9 + 1) * 128) = 243, three digits
    policy.cfg = dataclasses.replace(policy.cfg, max_prompt_len=need)
    assert policy._inputs(obs)["input_ids"].shape[1] == policy.processor.image_seq_length + need
    policy.cfg = dataclasses.replace(policy.cfg, max_prompt_len=need - 1)
    with pytest.raises(ConfigError, match=f"policy.max_prompt_len={need - 1}: .*use policy.max_prompt_len={need} "):
        policy._inputs(obs)


def test_two_cameras_and_an_unknown_state_length():
    """Image tokens are not counted (two cameras: the same count); an unknown state length counts the text alone."""
    policy = _policy("pi05")
    one = longest_prompt(policy.processor, TEXTS, num_cameras=1, state_dim=O)
    assert longest_prompt(policy.processor, TEXTS, num_cameras=2, state_dim=O) == one
    assert longest_prompt(policy.processor, TEXTS, num_cameras=1, state_dim=None)[0] == \
           1 + len(f"Task: {TEXTS[1]};\nAction: ")


def _libero(family, *over):
    return ["conf=libero_smoke", f"policy={family}_tiny", "env.obs_mode=rgb", "env.image_size=32", *over]


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_validate_refuses_a_prompt_length_too_small_for_libero_naming_one_that_works(family):
    """LIBERO's instructions and state length are known offline: load_config (pipelines.run's and validate's one check
    path) refuses a max_prompt_len the longest selected task's prompt does not fit, naming the length that does;
    that length passes."""
    from pipelines.config import load_config
    from tasks.envs import eval_task_names, instructions, state_dim
    cfg, _ = load_config(_libero(family), components=False)
    table = instructions(cfg.env)
    texts = [table[int(t)] for t in eval_task_names(cfg.env)] or table
    longest = max(texts, key=len)  # one token a byte: the longest text is the longest prompt
    state = ", State: " + " ".join(["100"] * state_dim(cfg.env)) if family == "pi05" else ""
    need = 1 + len(f"Task: {longest}{state};\nAction: ") if family == "pi05" else 1 + len(longest) + 1
    with pytest.raises(ConfigError) as e:
        load_config(_libero(family, f"policy.max_prompt_len={need - 1}"))
    assert e.value.key == "policy.max_prompt_len" and f"use policy.max_prompt_len={need}" in str(e.value)
    assert "\n" not in str(e.value)
    from tasks.config import replace_key
    from tasks.policies import check_components
    check_components(replace_key(cfg, "policy.max_prompt_len", need))  # the rule load_config ran: passes


# ---------------------------------------------------------------- parameter names on the meta device
@pytest.mark.parametrize("family, kw", [("pi0", {}), ("pi05", {"noise_method": "flow_noise"}),
                                        ("pi0", {"lora_rank": 4, "freeze": ["hf.model.vlm.vision_tower"]})])
def test_meta_names_and_trainable_set_are_the_built_policys(family, kw):
    """tasks.policies.parameter_names (what lr_scale is checked against) equals the built policy's
    named_parameters(), LoRA adapters and heads included; requires_grad on the meta layout equals the policy's."""
    from tasks.config import Config
    from tasks.policies import parameter_names
    from tasks.policies.pi0.names import meta_policy
    policy = _policy(family, **kw)
    cfg = Config(policy=policy.cfg)
    assert parameter_names(cfg) == [n for n, _ in policy.named_parameters()]
    meta = meta_policy(policy.cfg)
    assert {n for n, q in meta.named_parameters() if q.requires_grad} == \
           {n for n, q in policy.named_parameters() if q.requires_grad}


def test_a_freeze_prefix_matching_nothing_names_a_close_match():
    from pipelines.config import load_config
    base = ["conf=smoke", "env=pushcube_vla", "policy=pi0_tiny"]
    with pytest.raises(ConfigError, match=r"under 'hf.model.vlm.vision_towr'.*did you mean 'hf.model.vlm.vision_tower'"):
        load_config([*base, "policy.freeze=[hf.model.vlm.vision_towr]"], components=False)
    with pytest.raises(ConfigError, match=r"under 'noise_head'"):  # flow_sde: the policy has no noise head
        load_config([*base, "policy.noise_method=flow_sde", "policy.freeze=[noise_head]"], components=False)
