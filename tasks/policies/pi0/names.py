"""A pi0 / pi05 policy's parameters offline: the library's model built on the meta device (no memory; the base
presets in well under a second, cached), held as the policy holds it (`hf`, beside the RL heads `value_head` and,
for Flow-Noise, `noise_head`), with the policy's training keys applied by the runtime's own rule
(tasks.policies.pi0.lora.configure_training's `apply_lora` and `set_trainable`: LoRA, `policy.freeze`, the unused
expert embedding). What the offline checks read: the freeze list's and `algorithm.lr_scale`'s prefixes
(tasks.policies.pi0.checks, tasks.policies.check_lr_scale) and the memory plan's trainable count
(tasks.policies.pi0.memory).
"""
from __future__ import annotations

import functools

from torch import nn


class MetaPolicy(nn.Module):
    """The parameter layout of a PI0Policy without its inputs: `hf` (the library's model) and the heads, on meta."""

    def __init__(self, hf: nn.Module, value_head: nn.Module, noise_head: nn.Module | None):
        super().__init__()
        self.hf, self.value_head, self.noise_head = hf, value_head, noise_head


@functools.lru_cache(maxsize=16)
def _meta_policy(cls_name: str, config_json: str, lora_rank: int, lora_alpha: float, lora_targets: tuple,
                 freeze: tuple, value_head: str, state_head: bool, flow_noise: bool) -> MetaPolicy:
    import json

    import torch
    import transformers

    from tasks.policies.flow_sampling import NoiseStdHead
    from tasks.policies.pi0.lora import apply_lora, set_trainable
    from tasks.policies.vla_common import ValueHead
    config = getattr(transformers, cls_name)(**json.loads(config_json))
    with torch.device("meta"):
        hf = getattr(transformers, cls_name.replace("Config", "ForConditionalGeneration"))(config)
        width = config.vlm_config.text_config.hidden_size  # as PI0Policy builds its heads
        heads = (ValueHead(width, min(width, 512), 1, value_head, config.max_state_dim if state_head else 0),
                 NoiseStdHead(config.dit_config.hidden_size, config.max_action_dim, 0.1, 0.2) if flow_noise else None)
        if lora_rank:
            apply_lora(hf, rank=lora_rank, alpha=lora_alpha, targets=lora_targets)
    policy = MetaPolicy(hf, *heads)
    set_trainable(policy, hf, lora=bool(lora_rank), freeze=freeze)  # ConfigError: a prefix matching nothing
    return policy


def meta_policy(p, lib_config=None, *, lora_rank: int | None = None, freeze=None) -> MetaPolicy:
    """The parameter layout of the policy that policy config `p` (pi0 / pi05) builds, on the meta device, with
    requires_grad as the runtime sets it. `lib_config`: the transformers config (default
    `tasks.policies.pi0.library.offline_config(p)`); `lora_rank` / `freeze` replace p's (what the memory plan's
    fixes try). Shared between calls (cached): read it, never change it.

    Raises:
        ConfigError: policy.lora_targets matching no Linear module, policy.freeze naming no parameter.
        OSError / ValueError: `p.model_path` holds no checkpoint of this family (tasks.policies.pi0.library).
    """
    if lib_config is None:
        from tasks.policies.pi0.library import offline_config
        lib_config = offline_config(p)
    rank = int(p.lora_rank if lora_rank is None else lora_rank)
    return _meta_policy(type(lib_config).__name__, lib_config.to_json_string(), rank, float(p.lora_alpha),
                        tuple(p.lora_targets) if rank else (), tuple(str(f) for f in (p.freeze if freeze is None
                                                                                     else freeze)),
                        p.value_head, type(lib_config).__name__ == "PI0Config", p.noise_method == "flow_noise")


def parameter_names(cfg) -> list[str]:
    """The `named_parameters()` names of the policy Config `cfg` builds (pi0 / pi05), offline (`meta_policy`): what
    `algorithm.lr_scale` prefixes are matched against (tasks.actor.optim.make_optimizer). Raises as `meta_policy`."""
    return [n for n, _ in meta_policy(cfg.policy).named_parameters()]
