"""The flow_vla policy family's config: a pi0-style flow-matching VLA (model: tasks.policies.flow_vla.model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tasks.config.registry import register_family
from tasks.policies.flow_vla.checks import CHECKS, inert_keys
from tasks.policies.vla_configuration import VLAConfig


@register_family("policy", "flow_vla", checks=CHECKS)
@dataclass(frozen=True)
class FlowVLAConfig(VLAConfig):
    name: str = "flow_vla"
    num_denoise_steps: int = 4  # K integration steps of the flow ODE/SDE
    noise_method: str = "flow_sde"  # flow_sde | flow_noise (piRL)
    noise_level: float = 0.5  # flow_sde: a in sigma_t = a * sqrt(t / (1 - t))
    noise_std_min: float = 0.08  # flow_noise: bounds of the learned noise std
    noise_std_max: float = 0.16  # flow_noise: upper bound of the learned noise std
    model: ClassVar[str] = "tasks.policies.flow_vla.model:FlowVLAPolicy"
    images: ClassVar[bool] = True
    inert_keys = staticmethod(inert_keys)
