"""The pi0 policy family's config: transformers' `PI0ForConditionalGeneration` trained with dagrl's RL
(tasks.policies.pi0.model)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from tasks.config.registry import register_family
from tasks.config.schema import PolicyConfig
from tasks.policies.pi0.checks import CHECKS, COMPONENT_CHECKS, inert_keys


# policy.lora_targets' default (tasks.policies.pi0.lora)
LORA_TARGETS = ("language_model.*_proj", "dit.*_proj")


@register_family("policy", "pi0", checks=CHECKS)
@dataclass(frozen=True)  # every config section is frozen (tasks.config.schema); a subclass must be too
class PI0PolicyConfig(PolicyConfig):
    """pi0 (Black et al. 2024) as transformers ships it. With `model_path` the directory's config.json and processor
    decide the architecture, the tokenizer and the normalisation statistics (`preset` is not read); without it
    `preset` builds a fresh random model (tasks.policies.pi0.library: tiny | base)."""

    name: str = "pi0"
    preset: str = "tiny"  # tiny (trains on a CPU) | base (the published pi0 config, 3.5 B parameters)
    num_denoise_steps: int = 4  # K integration steps of the flow ODE/SDE (pi0 infers with 10)
    noise_method: str = "flow_sde"  # flow_sde | flow_noise (piRL)
    noise_level: float = 0.5  # flow_sde: a in sigma_t = a * sqrt(t / (1 - t))
    noise_std_min: float = 0.08  # flow_noise: bounds of the learned noise std
    noise_std_max: float = 0.16  # flow_noise: upper bound of the learned noise std
    max_prompt_len: int = 48  # prompt tokens after the image tokens (the processor's text, padded / truncated)
    value_head: str = "mean_token"  # mean_token | first_token | last_token: pooling of the VLM prefix features
    value_detach: bool = False  # the critic's gradient stops at the prefix features
    # ----- what trains (tasks.policies.pi0.lora: LoRA through peft, the freeze list, gradient checkpointing) -----
    lora_rank: int = 0  # 0: full fine-tuning; r > 0: rank-r LoRA adapters, the library's model frozen but them
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank
    # fnmatch patterns of the library model's Linear modules to adapt (at a dot boundary; a bare name matches
    # anywhere); default: q/k/v/o + gate/up/down of the Gemma trunk and the action expert, not SigLIP
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    freeze: list[str] = field(default_factory=list)  # parameter-name prefixes frozen, e.g. hf.model.vlm.vision_tower
    gradient_checkpointing: bool = False  # recompute each decoder layer in the backward pass (keeps the KV cache)
    model: ClassVar[str] = "tasks.policies.pi0.model:PI0Policy"
    images: ClassVar[bool] = True
    cameras: ClassVar[int] = 2  # "rgb" and "wrist_rgb" (pixel_attention_mask marks the ones an env gives)
    memory_plan: ClassVar[bool] = True  # cluster.gpu_memory_gib is checked against tasks.policies.pi0.memory's plan
    # rules that read the env's instructions and a checkpoint's tokenizer (tasks.policies.check_components)
    component_checks: ClassVar[tuple] = COMPONENT_CHECKS
    inert_keys = staticmethod(inert_keys)
