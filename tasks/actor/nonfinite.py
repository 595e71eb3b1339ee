"""Non-finite values in rollout fields (`algorithm.nonfinite`: error | mask), screened where the math reads them.

`advantages` (tasks.actor.entries) is where rollout fields enter the math:
  - error (default): a NaN/inf in a field the update would read (rewards, obs, actions, logprobs, values,
    final_values, bootstrap_values, float extras/*) raises `NonFiniteError`, one line naming the field, shard, env,
    chunk step and weight version.
  - mask: the chunk steps holding one (and, for GAE, every earlier step of the same episode whose advantage it
    makes undefined; for GRPO, the whole env when its scored episode has a non-finite reward) leave the loss
    mask, their non-finite entries are replaced by 0 (so nothing reaches a forward pass or a gradient), and the
    update reports `rollout/nonfinite_<field>` (chunk steps with a non-finite <field>, summed over shards) and
    `rollout/nonfinite_dropped` (chunk steps removed from the loss).
The update's own rule (a step whose loss or gradient norm is non-finite is skipped) is tasks.actor.optim's
`optimizer_step`.
"""
from __future__ import annotations

import numpy as np

from tasks import trajectory as tj
from tasks.algorithms import get_estimator
from tasks.config import Config


class NonFiniteError(ValueError):
    """A NaN/inf in a rollout field the update would train on (`algorithm.nonfinite=error`); one line."""


def screen_inputs(cfg: Config, traj: dict, shard: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Check every float field of one shard's trajectory where the math reads it.

    Returns (bad [T, B] bool: chunk steps whose obs / actions / logprobs / values / extras are non-finite (rewards,
    final_values and bootstrap_values act through the advantages instead), {field: [T, B] bool (bootstrap_values:
    [B]) chunk steps with a non-finite entry of that field}). Raises NonFiniteError with algorithm.nonfinite=error.
    """
    critic = get_estimator(cfg.algorithm.name).spec.critic  # values and bootstrap values are read with a critic
    executed = np.asarray(traj["step_mask"])  # [T, B, C]
    active = executed.any(-1)  # [T, B]
    T, B = active.shape
    ended = np.asarray(traj["truncated"]) & ~np.asarray(traj["terminated"])  # [T, B] V(final_obs) read there
    fields: list[tuple[str, np.ndarray]] = [("rewards", executed), ("obs", active), ("actions", executed),
                                            ("logprobs", executed)]
    if critic:
        fields += [("values", active), ("final_values", ended), ("bootstrap_values", np.ones(B, bool))]
    fields += [(k, active) for k in traj if tj.is_extra(k)]
    bad_steps = np.zeros((T, B), bool)
    found: dict[str, np.ndarray] = {}
    for name, where in fields:
        x = np.asarray(traj[name])
        if not np.issubdtype(x.dtype, np.floating):
            continue
        nf = ~np.isfinite(x)
        nf = nf.reshape(*nf.shape[:where.ndim], -1).any(-1) if nf.ndim > where.ndim else nf  # [T, B, (C)]
        nf &= where
        if not nf.any():
            continue
        per_step = nf if name == "bootstrap_values" else nf.reshape(T, B, -1).any(-1)  # [T, B] ([B])
        if cfg.algorithm.nonfinite == "error":
            first = np.argwhere(nf)[0]
            where_txt = "env " + (f"{first[0]} after the last chunk step" if name == "bootstrap_values" else
                                  f"{first[1]}, chunk step {first[0]}" + (f", action {first[2]}" if nf.ndim > 2 else ""))
            v = traj.get(tj.Meta.WEIGHT_VERSION)
            raise NonFiniteError(
                f"non-finite {name}: {int(nf.sum())} value(s) in the rollout of shard "
                f"{'?' if shard is None else shard}{'' if v is None else f' (weights v{v})'}, first at {where_txt}: "
                f"fix its source, or set algorithm.nonfinite=mask to drop such samples from the loss and count them "
                f"(rollout/nonfinite_{name.replace('/', '_')})")
        found[name] = per_step
        if name in ("obs", "actions", "logprobs", "values") or tj.is_extra(name):
            bad_steps |= per_step
    return bad_steps, found


def finite(x: np.ndarray) -> np.ndarray:
    """x with NaN/inf replaced by 0 (x itself when it is all finite or not float)."""
    if not np.issubdtype(np.asarray(x).dtype, np.floating) or np.isfinite(x).all():
        return x
    return np.where(np.isfinite(x), x, 0).astype(x.dtype)


def report(found: dict[str, np.ndarray], dropped: np.ndarray) -> dict[str, float]:
    """{field: chunk steps with a non-finite entry} (bootstrap_values: envs) and "dropped" (chunk steps removed)."""
    out = {k.replace("/", "_"): float(v.sum()) for k, v in found.items()}
    out["dropped"] = float(dropped.sum())
    return out


def nonfinite_metrics(samples: tuple[dict, ...]) -> dict[str, float]:
    """`rollout/nonfinite_<field>` summed over the shards' `advantages` outputs (their "nonfinite" counts)."""
    out: dict[str, float] = {}
    for s in samples:
        for k, v in (s.get("nonfinite") or {}).items():
            out[f"rollout/nonfinite_{k}"] = out.get(f"rollout/nonfinite_{k}", 0.0) + float(v)
    return out
