"""Offload/onload of the actor (model + optimizer state) and of rollout replicas between phases
(`algorithm.offload`, RLinf's `enable_offload`).

When the actor and the rollout replicas share a GPU (colocated placement), each phase holds device memory only
while it runs: the actor's parameters, gradients and optimizer moments move to CPU memory after the update and back
before the next one; a replica moves to CPU memory after its worker's last rollout node of the step and back when
the next one needs it. On a CPU-only machine every move is cpu -> cpu, i.e. a no-op: the same code path runs,
measures and logs zero device savings.

Metrics of the actor update node (`tasks.actor.entries.actor_update_offload`): `time/offload` (seconds moving the actor: onload
before + offload after), `system/actor_device_mb_before_offload` / `..._after_offload` (MB of the actor's
parameter, gradient and optimizer-state tensors on its compute device right after the update and after the
offload) and, on CUDA, `system/cuda_allocated_mb_before_offload` / `..._after_offload`
(`torch.cuda.memory_allocated`).
"""
from __future__ import annotations

import time

import torch


def _optimizer_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                yield state, k, v


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every tensor of the optimizer's per-parameter state (Adam's `exp_avg`, `exp_avg_sq`, `step`, ...)
    to `device`, in place of the old ones (so the old device's memory is freed). Returns the bytes moved.

    Adam keeps its `step` counters on the CPU unless `capturable`/`fused`; they are moved like the rest only when
    they live on the parameters' device, i.e. scalar CPU steps stay where Adam expects them."""
    device = torch.device(device)
    moved = 0
    for state, k, v in list(_optimizer_tensors(optimizer)):
        if k == "step" and v.dim() == 0 and v.device.type == "cpu":
            continue  # Adam's default: a CPU scalar step counter, whatever the parameters' device
        if v.device != device:
            state[k] = v.to(device, non_blocking=False)
            moved += v.numel() * v.element_size()
    return moved


def move_module(module: torch.nn.Module, device: torch.device | str) -> int:
    """Move a module's parameters, their gradients and buffers to `device` in place (`Module.to` keeps the
    Parameter objects, so an optimizer built on them stays valid). Returns the bytes moved."""
    device = torch.device(device)
    moved = sum(t.numel() * t.element_size() for t in _module_tensors(module) if t.device != device)
    module.to(device)
    for p in module.parameters():
        if p.grad is not None and p.grad.device != device:
            p.grad = p.grad.to(device)
    return moved


def _module_tensors(module: torch.nn.Module):
    for p in module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
    yield from module.buffers()


def device_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> int:
    """Bytes of the module's parameters, gradients, buffers and the optimizer's state tensors that live on `device`
    (matched by device type and, for CUDA, index)."""
    device = torch.device(device)

    def on(t: torch.Tensor) -> bool:
        return t.device.type == device.type and (device.index is None or t.device.index in (None, device.index))
    ts = list(_module_tensors(module)) + ([v for _, _, v in _optimizer_tensors(optimizer)] if optimizer else [])
    return int(sum(t.numel() * t.element_size() for t in ts if on(t)))


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (cpu for a module without parameters)."""
    p = next(module.parameters(), None)
    return torch.device("cpu") if p is None else p.device


def onload(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device | str) -> float:
    """Move module (and optimizer state) to its compute `device`; returns the seconds it took."""
    t0 = time.perf_counter()
    move_module(module, device)
    if optimizer is not None:
        move_optimizer_state(optimizer, device)
    _sync(device)
    return time.perf_counter() - t0


def offload(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, compute_device: torch.device | str
            ) -> dict[str, float]:
    """Move module (and optimizer state) from `compute_device` to CPU memory.

    Returns `seconds` and `device_mb_before` / `device_mb_after` (MB of those tensors on `compute_device`; equal
    on a CPU-only machine, where the move is a no-op), plus `cuda_allocated_mb_before` / `_after` on CUDA.
    """
    dev = torch.device(compute_device)
    out = {"device_mb_before": device_bytes(module, optimizer, dev) / 1e6}
    if dev.type == "cuda":
        out["cuda_allocated_mb_before"] = torch.cuda.memory_allocated(dev) / 1e6
    t0 = time.perf_counter()
    move_module(module, "cpu")
    if optimizer is not None:
        move_optimizer_state(optimizer, "cpu")
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    out["seconds"] = time.perf_counter() - t0
    out["device_mb_after"] = device_bytes(module, optimizer, dev) / 1e6
    if dev.type == "cuda":
        out["cuda_allocated_mb_after"] = torch.cuda.memory_allocated(dev) / 1e6
    return out


def _sync(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
