"""The actor's optimizer: Adam over the policy's parameters with one param group per learning rate
(`algorithm.lr`, `algorithm.critic_lr` for the value head, `algorithm.lr_scale` factors by name prefix; factor 0
freezes), the linear learning-rate anneal (`algorithm.lr_anneal_steps`), and THE step rule of every actor update
(`optimizer_step`: clip, then step only when the loss and the gradient norms are finite).
"""
from __future__ import annotations

import math

import torch

from tasks.config import Config


def make_optimizer(cfg: Config, policy: torch.nn.Module) -> torch.optim.Optimizer:
    """The actor's optimizer: Adam(eps=1e-5) over `policy.parameters()` (after any sharding), one param group per
    learning rate, in parameter order of first appearance.

    A parameter's learning rate is `algorithm.lr` — `algorithm.critic_lr` for the value head's (names starting
    with `value_head.`) when that is set (a fresh critic on a pretrained VLA needs a larger step than the policy) —
    times the factor of the longest `algorithm.lr_scale` prefix its name starts with (1 without one). A factor 0
    freezes the parameter: `requires_grad_(False)`, outside the optimizer (no state; `clip_grad_norm_` skips it).

    Raises:
        ValueError: `critic_lr` set for a policy without a value head; an `lr_scale` key that is no parameter-name
            prefix (the message lists the policy's top-level modules).
    """
    a = cfg.algorithm
    named = list(policy.named_parameters())
    if a.critic_lr is not None and not any(n.startswith("value_head.") for n, _ in named):
        raise ValueError(f"algorithm.critic_lr={a.critic_lr}: the {type(policy).__name__} has no value_head")
    names = [n for n, _ in named]
    for key in a.lr_scale:
        if not any(n == key or n.startswith(key + ".") for n in names):
            top = sorted({".".join(n.split(".")[:2]) for n in names})
            raise ValueError(f"algorithm.lr_scale.{key}: no parameter of the {type(policy).__name__} is under "
                             f"{key!r}; its modules: {', '.join(top)}")
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for n, p in named:
        lr = param_lr(a, n)
        if lr == 0.0:
            p.requires_grad_(False)
            continue
        groups.setdefault(lr, []).append(p)
    if len(groups) == 1:
        (lr, params), = groups.items()
        return torch.optim.Adam(params, lr=lr, eps=1e-5)
    return torch.optim.Adam([{"params": ps, "lr": lr} for lr, ps in groups.items()], eps=1e-5)


def lr_factor(a, version: int) -> float:
    """The learning-rate factor of the update from weight version `version`: max(0, 1 - version /
    algorithm.lr_anneal_steps), 1 when that is None (AlgorithmConfig.lr_anneal_steps)."""
    if a.lr_anneal_steps is None:
        return 1.0
    return max(0.0, 1.0 - version / a.lr_anneal_steps)


def set_annealed_lr(a, opt: torch.optim.Optimizer, version: int) -> None:
    """Set every param group's lr to its `initial_lr` (make_optimizer's lr, kept in the group and in the optimizer's
    state dict, as torch's LR schedulers do) times `lr_factor(a, version)`."""
    f = lr_factor(a, version)
    for g in opt.param_groups:
        g["lr"] = g.setdefault("initial_lr", g["lr"]) * f


def param_lr(a, name: str) -> float:
    """The learning rate of the parameter `name` under AlgorithmConfig `a` (make_optimizer's rule)."""
    base = a.critic_lr if a.critic_lr is not None and name.startswith("value_head.") else a.lr
    match = [k for k in a.lr_scale if name == k or name.startswith(k + ".")]
    return base * (a.lr_scale[max(match, key=len)] if match else 1.0)


def split_critic(policy: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(the policy's parameters outside the value head, the value head's: names starting with `value_head.`)."""
    named = list(policy.named_parameters())
    return ([p for n, p in named if not n.startswith("value_head.")],
            [p for n, p in named if n.startswith("value_head.")])


def optimizer_step(opt: torch.optim.Optimizer, groups: list[list[torch.nn.Parameter]], max_norm: float, *,
                   loss_finite: bool = True) -> tuple[bool, list[float]]:
    """THE rule of every actor update (RL epochs and SFT): clip each parameter group's gradient to `max_norm`
    (`clip_grad_norm_`; sharded DTensor norms made global, so every rank decides alike), then step the optimizer
    only if the loss and every group's norm are finite; otherwise drop the gradients (parameters and optimizer
    state unchanged). Returns (applied, the groups' pre-clip norms)."""
    from torch.distributed.tensor import DTensor
    norms = []
    for params in groups:
        gn = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norms.append(float(gn.full_tensor() if isinstance(gn, DTensor) else gn))
    if not loss_finite or not all(math.isfinite(n) for n in norms):
        opt.zero_grad(set_to_none=True)
        return False, norms
    opt.step()
    return True, norms
