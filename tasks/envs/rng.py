"""The torch RNG state of an env shard's policy calls (`EnvShard.policy_rng`, `seed_rng`) and its cursor form
(lists of ints: JSON- and weights_only-safe)."""
from __future__ import annotations


def cuda_devices(device) -> list:
    """[the CUDA device index] for a CUDA policy device, else [] (fork_rng then forks the CPU RNG only)."""
    if device is None:
        return []
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def get_rng(devs: list) -> dict:
    """The torch RNG states of the CPU and of CUDA devices `devs`: {"cpu": uint8 tensor, "cuda": [uint8 tensor]}."""
    import torch
    return {"cpu": torch.get_rng_state(), "cuda": [torch.cuda.get_rng_state(d) for d in devs]}


def rng_to_lists(state: dict | None):
    """Torch RNG states (uint8 tensors) -> {"cpu": [int], "cuda": [[int]]} (JSON- and weights_only-safe)."""
    if state is None:
        return None
    return {"cpu": state["cpu"].tolist(), "cuda": [s.tolist() for s in state.get("cuda") or []]}


def rng_from_lists(state: dict) -> dict:
    """The inverse of `rng_to_lists`: lists of ints -> torch RNG states (uint8 tensors)."""
    import torch
    return {"cpu": torch.tensor(state["cpu"], dtype=torch.uint8),
            "cuda": [torch.tensor(s, dtype=torch.uint8) for s in state.get("cuda") or []]}
