"""Where policies compute and in which precision: `policy.device` (cpu | cuda) and `policy.dtype`
(float32 | bfloat16, autocast on CUDA). Rollout replicas use these; numpy stays the exchange format between
nodes (`to_numpy`: float32 on the CPU)."""
from __future__ import annotations

import contextlib

import torch

from tasks.config import DEVICES, DTYPES, cuda_available  # noqa: F401  (the config's vocabulary; defined there)


def policy_device(cfg) -> torch.device:
    """The device rollout replicas compute on: `cuda` (this worker's CUDA device; the embedded cluster gives each
    GPU worker one via CUDA_VISIBLE_DEVICES) or `cpu`."""
    return torch.device("cuda") if cfg.policy.device == "cuda" else torch.device("cpu")


def autocast(dtype: str, device: torch.device):
    """Autocast context for `dtype` on `device`: bfloat16 mixed precision (matmuls in bf16, reductions in fp32),
    or nothing for float32."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(obs: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """An observation dict on `device` (a no-op on the CPU)."""
    if torch.device(device).type == "cpu":
        return obs
    return {k: v.to(device, non_blocking=True) for k, v in obs.items()}


def to_numpy(t: torch.Tensor):
    """A tensor as numpy on the CPU; floating tensors (bf16 under autocast) as float32."""
    t = t.detach()
    if t.is_floating_point() and t.dtype != torch.float32:
        t = t.float()
    return t.cpu().numpy()

