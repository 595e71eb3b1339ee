"""The token_vla policy family's config: an OpenVLA-OFT-style VLA with action tokens (tasks.policies.token_vla.model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tasks.config.registry import register_family
from tasks.policies.token_vla.checks import CHECKS, inert_keys
from tasks.policies.vla_configuration import VLAConfig


@register_family("policy", "token_vla", checks=CHECKS)
@dataclass(frozen=True)
class TokenVLAConfig(VLAConfig):
    name: str = "token_vla"
    action_bins: int = 256  # bins per action dimension
    # the softmax temperature of the sampled tokens (rollout act, evaluate, entropy); the argmax tokens of a
    # deterministic act (the eval) do not depend on it
    temperature: float = 1.0
    model: ClassVar[str] = "tasks.policies.token_vla.model:TokenVLAPolicy"
    images: ClassVar[bool] = True
    inert_keys = staticmethod(inert_keys)
