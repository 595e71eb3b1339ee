"""The mlp policy family's config: a Gaussian MLP actor-critic on the state vector (model: tasks.policies.mlp.model)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from tasks.config.registry import register_family
from tasks.config.schema import PolicyConfig
from tasks.policies.mlp.checks import CHECKS


@register_family("policy", "mlp", checks=CHECKS)
@dataclass(frozen=True)
class MLPConfig(PolicyConfig):
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256, 256])  # widths of the hidden layers
    activation: str = "tanh"  # tanh | relu | gelu
    init_logstd: float = -0.5  # initial log std of the Gaussian actions
    model: ClassVar[str] = "tasks.policies.mlp.model:MLPPolicy"
    images: ClassVar[bool] = False  # reads the state vector only (no camera image)
    checkpoint_keys: ClassVar[tuple] = ("hidden_sizes", "activation")  # a model_path saved with others is refused
