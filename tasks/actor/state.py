"""THE actor state format, for 1 and R ranks: weights, optimizer (FQN keys) and RNG, built on
`torch.distributed.checkpoint.state_dict`, so a checkpoint of 1 rank loads on R ranks and back.

    {"policy":         full CPU state dict of the policy (get_model_state_dict(full_state_dict, cpu_offload)),
     "optimizer":      {"state": {param FQN: {"step", "exp_avg", ...}} for the parameters that have state,
                        "param_groups": [{hyper-parameters, "params": [param FQNs]}]} (get_optimizer_state_dict),
     "rng":            this process's RNG streams (`rng_state`: {"torch", "numpy", "python"[, "cuda"]}; a state
                        may hold only some of them: `set_rng_state` restores those it has),
     "weight_version": int,
     "policy_ema":     the averaged weights, CPU float32, key for key (only with algorithm.ema_decay > 0)}

The one-rank actor (`tasks.actor.entries.actor_state`) and rank 0 of the sharded actor
(`tasks.actor.distributed.actor_state_rank`) both return `actor_state_dict(...)`; a checkpoint holds it plus the
runner's `run` entry. Plain modules need no process group; FSDP2-sharded ones make it a collective (the full
state on rank 0, {} elsewhere).

Optimizer: parameters that had no state when saved (no gradient yet: the actor during critic warm-up, a frozen
part) have none after loading either, so Adam starts them at step 0 as the uninterrupted run would. torch's helpers
give every parameter of an empty optimizer a zero step first (saving and loading); that is undone here. The saved
param_groups must name the same parameters as the optimizer's, group by group (ValueError otherwise).

A run directory written in an older format (integer-keyed optimizer states, torch-only RNG states) is refused where
it is loaded (storage.checkpoints) and rewritten once by `python -m pipelines.upgrade RUN_DIR`.
"""
from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["actor_state_dict", "model_state", "load_model_state", "optimizer_state", "load_optimizer_state",
           "rng_state", "set_rng_state", "STATE_KEYS"]

STATE_KEYS = ("policy", "optimizer", "rng", "weight_version")  # always present; "policy_ema" when kept


def _full(cpu_offload: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


def _param_names(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names (FQNs) of each of the optimizer's param_groups, in the group's order."""
    names = {p: n for n, p in policy.named_parameters()}
    try:
        return [[names[p] for p in g["params"]] for g in opt.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the policy's") from None


# ---------------------------------------------------------------- weights
def model_state(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's full state dict as CPU tensors that hold no reference into the module (copies): plain and
    FSDP2-sharded modules alike (`get_model_state_dict`; a collective for the latter)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    sd = get_model_state_dict(policy, options=_full())
    return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}


def load_model_state(policy: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (`model_state`) into the policy, plain or sharded (`set_model_state_dict`, strict).

    Raises:
        RuntimeError: missing or unexpected keys, or a shape mismatch (torch's message)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(policy, dict(state), options=StateDictOptions(full_state_dict=True, strict=True))


# ---------------------------------------------------------------- optimizer (FQN keys)
def optimizer_state(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter name (FQN), CPU tensors: {"state": {name: {"step", "exp_avg",
    ...}} for the parameters that have state, "param_groups": [{hyper-parameters, "params": [names]}]}.

    `get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)` for plain and FSDP2-sharded modules (a
    collective for the latter: the full state on rank 0, {} elsewhere). Saving never adds state to the live
    optimizer: torch's helper initialises an empty optimizer with a zero step (step 1 for every parameter), which is
    undone here.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    had = {p for p in opt.state if opt.state[p]}
    full = get_optimizer_state_dict(policy, opt, options=_full())
    added = [p for p in list(opt.state) if p not in had]
    if added:  # torch's _init_optim_state ran: drop what it made (the saved dict must not hold it either)
        names = {p: n for n, p in policy.named_parameters()}
        for p in added:
            opt.state.pop(p, None)
            if full:
                full["state"].pop(names[p], None)
    return _cpu(full)


def load_optimizer_state(policy: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a state from `optimizer_state` into `opt`, for plain and FSDP2 modules (a collective for the latter:
    every rank passes the same full state).

    Parameters without saved state get none (a later first step initialises them as in the uninterrupted run);
    hyper-parameters (lr, betas, eps, initial_lr) come from the saved param_groups.

    Raises:
        ValueError: the saved param_groups do not name the same parameters as this optimizer's (group by group),
            state for a parameter this policy does not have, or a state that is not FQN-keyed (a run of an older
            format: `python -m pipelines.upgrade RUN_DIR`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    groups = state.get("param_groups", [])
    if not all(isinstance(i, str) for g in groups for i in g["params"]) or \
            not all(isinstance(k, str) for k in state.get("state", {})):
        raise ValueError("optimizer state: not keyed by parameter name (a checkpoint of an older format): "
                         "rewrite its run directory once with `python -m pipelines.upgrade RUN_DIR`")
    names = _param_names(policy, opt)
    saved = [list(g["params"]) for g in groups]
    if [sorted(g) for g in saved] != [sorted(g) for g in names]:
        diff = sorted(set().union(*map(set, saved)) ^ set().union(*map(set, names)))
        raise ValueError(f"optimizer state: its param_groups name other parameters than this optimizer's "
                         f"({len(saved)} vs {len(names)} groups; differing: {diff[:6]}): a checkpoint of another "
                         f"policy, or algorithm.critic_lr / algorithm.lr_scale changed (they must match the "
                         f"checkpoint's run)")
    unknown = set(state["state"]) - {n for g in names for n in g}
    if unknown:
        raise ValueError(f"optimizer state for parameters this policy does not have: {sorted(unknown)[:6]}")
    for g, saved_g in zip(opt.param_groups, groups):
        # torch's loader maps only the keys the live groups already have: a saved key they lack
        # (set_annealed_lr's "initial_lr") raised KeyError there, so the groups take the saved hyper-parameters first
        g.update({k: v for k, v in saved_g.items() if k != "params"})
    set_optimizer_state_dict(policy, opt, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
    for g, saved_g in zip(opt.param_groups, groups):  # torch's loader made tuples (betas) lists: the saved values
        g.update({k: v for k, v in saved_g.items() if k != "params"})
    for n, p in policy.named_parameters():  # torch's loader gave every parameter a zero step first: undo it where
        if n not in state["state"]:  # none was saved
            opt.state.pop(p, None)


# ---------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """This process's RNG states in a checkpoint-loadable form (tensors, lists, ints: what
    `torch.load(weights_only=True)` loads back): {"torch": ByteTensor, "numpy": {"bit_generator", "key": [624
    ints], "pos", "has_gauss", "gauss"}, "python": [version, [625 ints], gauss or None], "cuda": [ByteTensor per
    device] (only with CUDA initialised)}. Restore with `set_rng_state`."""
    np_state = np.random.get_state(legacy=False)
    py = random.getstate()
    out = {"torch": torch.get_rng_state(),
           "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                     "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                     "gauss": float(np_state["gauss"])},
           "python": [py[0], list(py[1]), py[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what `rng_state` returned: each of torch, numpy, python and cuda (when available) that `state`
    holds (a state upgraded from a torch-only one holds "torch" alone; the other streams are left as they are)."""
    if state.get("torch") is not None:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8).cpu())
    n = state.get("numpy")
    if n is not None:
        np.random.set_state({"bit_generator": n["bit_generator"],
                             "state": {"key": np.asarray(n["key"], np.uint32), "pos": int(n["pos"])},
                             "has_gauss": int(n["has_gauss"]), "gauss": float(n["gauss"])})
    p = state.get("python")
    if p is not None:
        random.setstate((int(p[0]), tuple(int(x) for x in p[1]), p[2]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.as_tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ---------------------------------------------------------------- the whole state
def actor_state_dict(policy: torch.nn.Module, opt: torch.optim.Optimizer, version: int,
                     ema: dict | None = None, *, rank: int = 0) -> dict:
    """The actor's state in THE format of the module docstring. For a sharded policy a collective: call it on every
    rank with its `rank`; rank 0 (or the one process) gets the state, other ranks {}."""
    policy_sd = model_state(policy)
    optim_sd = optimizer_state(policy, opt)
    if rank != 0:
        return {}
    out = {"policy": policy_sd, "optimizer": optim_sd, "rng": rng_state(), "weight_version": int(version)}
    if ema is not None:
        out["policy_ema"] = {k: v.clone() for k, v in ema.items()}
    return out


def _cpu(obj):
    """A nested state (dicts / lists of tensors) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj
