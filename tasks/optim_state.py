"""Optimizer state in one format for the one-rank and the multi-rank (FSDP2) actor: the FQN-keyed full state of
`torch.distributed.checkpoint.state_dict`, {"state": {param name: {"step", "exp_avg", ...}}, "param_groups":
[{hyper-parameters, "params": [param names]}]}, so a checkpoint of 1 rank loads on R ranks and back.

Parameters that had no state when saved (no gradient yet: the actor during critic warm-up, a frozen part) have none
after loading either, so Adam starts them at step 0 as the uninterrupted run would. torch's loader (and its saver,
on an empty optimizer) gives every parameter a zero step first; that is undone here. The saved param_groups must
name the same parameters as the optimizer's, group by group (ValueError otherwise). Checkpoints written before
this format (a one-process `optimizer.state_dict()`, integer ids) are mapped by position.
"""
from __future__ import annotations

import torch

__all__ = ["optimizer_state", "load_optimizer_state"]


def _is_sharded(policy: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor
    return any(isinstance(p, DTensor) for p in policy.parameters())


def _param_names(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names (FQNs) of each of the optimizer's param_groups, in the group's order."""
    names = {p: n for n, p in policy.named_parameters()}
    try:
        return [[names[p] for p in g["params"]] for g in opt.param_groups]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the policy's") from None


def optimizer_state(policy: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter name (FQN), CPU tensors: {"state": {name: {"step", "exp_avg",
    ...}} for the parameters that have state, "param_groups": [{hyper-parameters, "params": [names]}]}.

    Plain modules: converted from `opt.state_dict()` (no process group needed). FSDP2-sharded modules: a collective
    (`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(full_state_dict=True, cpu_offload=True)`;
    the full state on rank 0, {} elsewhere). Saving never adds state to the live optimizer: torch's helper
    initialises an empty optimizer with a zero step (step 1 for every parameter), which is undone here.
    """
    if not _is_sharded(policy):
        names, sd = _param_names(policy, opt), opt.state_dict()
        flat = [n for g in names for n in g]  # state_dict's integer ids are positions in this order
        return {"state": {flat[i]: _cpu(v) for i, v in sd["state"].items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": names[j]}
                                 for j, g in enumerate(sd["param_groups"])]}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    had = {p for p in opt.state if opt.state[p]}
    full = get_optimizer_state_dict(policy, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    added = [p for p in list(opt.state) if p not in had]
    if added:  # torch's _init_optim_state ran: drop what it made (the saved dict must not hold it either)
        names = {p: n for n, p in policy.named_parameters()}
        for p in added:
            opt.state.pop(p, None)
            if full:
                full["state"].pop(names[p], None)
    return full


def _fqn_keyed(policy: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> dict:
    """An optimizer state in the FQN-keyed format; a one-process `opt.state_dict()` (integer ids: checkpoints
    written before this format) is mapped by position onto this optimizer's parameters."""
    groups = state.get("param_groups", [])
    ids = [i for g in groups for i in g["params"]]
    if all(isinstance(i, str) for i in ids) and all(isinstance(k, str) for k in state.get("state", {})):
        return state
    names = _param_names(policy, opt)
    if [len(g["params"]) for g in groups] != [len(g) for g in names]:
        raise ValueError(f"optimizer state has param_groups of sizes {[len(g['params']) for g in groups]}, this "
                         f"optimizer {[len(g) for g in names]}: a different policy, algorithm.critic_lr or algorithm.lr_scale setting")
    pos = {i: n for g_ids, g_names in zip((g["params"] for g in groups), names) for i, n in zip(g_ids, g_names)}
    return {"state": {pos[i]: v for i, v in state.get("state", {}).items()},
            "param_groups": [{**g, "params": names[j]} for j, g in enumerate(groups)]}


def load_optimizer_state(policy: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    """Load a state from `optimizer_state` (or a legacy integer-keyed one) into `opt`, for plain and FSDP2 modules
    (a collective for the latter: every rank passes the same full state).

    Parameters without saved state get none (a later first step initialises them as in the uninterrupted run);
    hyper-parameters (lr, betas, eps) come from the saved param_groups.

    Raises:
        ValueError: the saved param_groups do not name the same parameters as this optimizer's (group by group),
            or state for a parameter this policy does not have.
    """
    state = _fqn_keyed(policy, opt, state)
    names = _param_names(policy, opt)
    saved = [list(g["params"]) for g in state["param_groups"]]
    if [sorted(g) for g in saved] != [sorted(g) for g in names]:
        diff = sorted(set().union(*map(set, saved)) ^ set().union(*map(set, names)))
        raise ValueError(f"optimizer state: its param_groups name other parameters than this optimizer's "
                         f"({len(saved)} vs {len(names)} groups; differing: {diff[:6]}): a checkpoint of another "
                         f"policy, or algorithm.critic_lr / algorithm.lr_scale changed (they must match the checkpoint's run)")
    unknown = set(state["state"]) - {n for g in names for n in g}
    if unknown:
        raise ValueError(f"optimizer state for parameters this policy does not have: {sorted(unknown)[:6]}")
    if not _is_sharded(policy):
        flat = [n for g in names for n in g]
        ids = {n: i for i, n in enumerate(flat)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids[n] for n in names[j]]}
                  for j, g in enumerate(state["param_groups"])]
        # the saved group's hyper-parameters, this optimizer's parameter order (the names match as sets)
        opt.load_state_dict({"state": {ids[n]: v for n, v in state["state"].items()}, "param_groups": groups})
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    for g, saved_g in zip(opt.param_groups, state["param_groups"]):
        # torch's loader maps only the keys the live groups already have: a saved key they lack
        # (set_annealed_lr's "initial_lr") raised KeyError there, so the groups take the saved hyper-parameters first
        g.update({k: v for k, v in saved_g.items() if k != "params"})
    set_optimizer_state_dict(policy, opt, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True, strict=False))
    by_name = dict(policy.named_parameters())
    for n, p in by_name.items():  # torch's loader gave every parameter a zero step first: undo it where none was saved
        if n not in state["state"]:
            opt.state.pop(p, None)


def _cpu(obj):
    """A nested state (dicts / lists of tensors) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj
