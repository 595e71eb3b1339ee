"""The pi05 policy family's config: transformers' `PI05ForConditionalGeneration` trained with dagrl's RL
(tasks.policies.pi05.model). Its keys are pi0's (tasks.policies.pi0.configuration); the prompt is longer: pi0.5's
processor writes the discretised state into it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tasks.config.registry import register_family
from tasks.policies.pi0.checks import CHECKS, inert_keys
from tasks.policies.pi0.configuration import PI0PolicyConfig


@register_family("policy", "pi05", checks=CHECKS)
@dataclass(frozen=True)
class PI05PolicyConfig(PI0PolicyConfig):
    """pi0.5 (Physical Intelligence 2025) as transformers ships it; `preset` base = the published 3.35 B config."""

    name: str = "pi05"
    # "Task: <task>, State: <bins>;\nAction: " after the image tokens (PI05Processor's max_length 200 counts those
    # too): the tiny byte-level tokenizer spends up to 4 tokens on a state dimension (PushCube's 35: ~140)
    max_prompt_len: int = 256
    model: ClassVar[str] = "tasks.policies.pi05.model:PI05Policy"
    inert_keys = staticmethod(inert_keys)
