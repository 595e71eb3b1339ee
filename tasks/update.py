"""Advantage and actor-update task functions, and the actor resident on the GPU-resource worker.

Flattening: a trajectory's [T, B, ...] fields become [N = T*B, ...] samples for the update. With
`reward_type=chunk_level` advantages/returns are [N]; with `action_level` they are [N, C] and values [N, C].

One update loop for one and many ranks (`run_update`): the one-rank `actor_update` is a world of size 1 (no
collective), `tasks.distributed.actor_update_rank` the same function with `torch.distributed.all_reduce`. Critic
warm-up, skipping non-finite steps, the loss weighting, target_kl, metrics and the randomness rule exist once.

Non-finite values (`algorithm.nonfinite`: error | mask; `advantages` is where rollout fields enter the math):
  - error (default): a NaN/inf in a field the update would read (rewards, obs, actions, logprobs, values,
    final_values, bootstrap_values, float extras/*) raises `NonFiniteError`, one line naming the field, shard, env,
    chunk step and weight version.
  - mask: the chunk steps holding one (and, for GAE, every earlier step of the same episode whose advantage it
    makes undefined; for GRPO, the whole env when its scored episode has a non-finite reward) leave the loss
    mask, their non-finite entries are replaced by 0 (so nothing reaches a forward pass or a gradient), and the
    update reports `rollout/nonfinite_<field>` (chunk steps with a non-finite <field>, summed over shards) and
    `rollout/nonfinite_dropped` (chunk steps removed from the loss).
  - the update (both modes): an optimizer step whose loss or gradient norm is non-finite on any rank is skipped
    (no `optimizer.step`: parameters and optimizer state stay bit-identical), counted in `train/skipped_updates`;
    a minibatch with an empty loss mask is not stepped either (Adam would move the weights on a zero gradient
    through its momentum), counted in `train/empty_minibatches`. train/* loss metrics are means over the applied
    steps (NaN when none was applied: MLflow shows it).

Randomness (exact resume without saved update state): every draw of the update on weights version v is a function
of (cfg.seed, v, rank) only (the formulas: tasks.seeding). Minibatch permutations come from
`torch.Generator().manual_seed(permutation_seed(cfg, v))` (identical on every rank, each rank takes its slice); any
other torch draw inside the update (a policy's sampling in its loss, e.g. the flow VLA's `sft_loss`) comes from the
default generators forked for the update
(`update_rng`) and seeded with `update_seed(cfg, v, rank)`, so the process's own streams (rollout sampling on the
same worker) are neither consumed nor changed by an update. The step counters that schedule anything in the update
(critic warm-up: `algorithm.critic_warmup_steps` against v) come from the weight version, which the checkpoint
carries (`run.weight_version`); the learning rates are the optimizer's param_groups, saved with it.

Optimizer state (`tasks.optim_state.optimizer_state` / `load_optimizer_state`, re-exported here): one FQN-keyed
format for 1 and R ranks, so a checkpoint of one rank loads on R ranks and back; parameters without state when saved
(the actor during critic warm-up) have none after loading either.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from tasks import resident, seeding
from tasks import trajectory as tj
from tasks.algorithms import (aggregate_rewards, critic_loss, decoupled_ppo_actor_loss, entropy_bonus,
                              expand_advantages, get_estimator, loss_mask_for, masked_mean, normalize_advantages,
                              ppo_actor_loss, reduce_logprobs)
from tasks.config import Config
from tasks.device import autocast, policy_device, to_device
from tasks.optim_state import load_optimizer_state, optimizer_state  # noqa: F401 (re-exported)
from tasks.policies import make_policy
from tasks.rollout import image_size, instructions, num_values, policy_obs

SAMPLE_FIELDS = tj.SAMPLE_FIELDS  # the update's samples (tasks.trajectory: the `update` fields), extras/* on top


class NonFiniteError(ValueError):
    """A NaN/inf in a rollout field the update would train on (`algorithm.nonfinite=error`); one line."""


def _nonfinite_inputs(cfg: Config, traj: dict, shard: int | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
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


def _finite(x: np.ndarray) -> np.ndarray:
    """x with NaN/inf replaced by 0 (x itself when it is all finite or not float)."""
    if not np.issubdtype(np.asarray(x).dtype, np.floating) or np.isfinite(x).all():
        return x
    return np.where(np.isfinite(x), x, 0).astype(x.dtype)


def _nonfinite_report(found: dict[str, np.ndarray], dropped: np.ndarray) -> dict[str, float]:
    """{field: chunk steps with a non-finite entry} (bootstrap_values: envs) and "dropped" (chunk steps removed)."""
    out = {k.replace("/", "_"): float(v.sum()) for k, v in found.items()}
    out["dropped"] = float(dropped.sum())
    return out


def advantages(cfg: Config, traj: dict, shard: int | None = None) -> dict:
    """The advantages of one shard's trajectory by the estimator `algorithm.name` selects
    (tasks.algorithms.estimators: GAE per env, GRPO per group; envs are independent and groups never straddle
    shards, so shards are too). `shard` only names the shard in errors.

    Returns the sample fields [T, B, ...] (advantages/returns [T, B] for chunk-level rewards, [T, B, C] for
    action-level; loss_mask [T, B] bool: the chunk steps that enter the loss), rgb and extras/* when present,
    `stats` (reward/value/advantage means for logging) and `nonfinite` ({field: count}, see the module docstring;
    all finite: {"dropped": 0.0}).

    Raises:
        NonFiniteError: a NaN/inf where the math reads it, with algorithm.nonfinite=error (module docstring).
    """
    bad_steps, found = _nonfinite_inputs(cfg, traj, shard)
    if found:  # mask mode: nothing non-finite goes further; the chunk steps are dropped by the estimator
        traj = {k: (_finite(v) if isinstance(v, np.ndarray) else v) for k, v in traj.items()}
    res = get_estimator(cfg.algorithm.name).advantages(traj=traj, algorithm=cfg.algorithm,
                                                       num_action_chunks=cfg.policy.num_action_chunks,
                                                       bad_steps=bad_steps, bad_inputs=found)
    out = _passthrough(traj)
    out.update(advantages=res["advantages"], returns=res["returns"], loss_mask=res["loss_mask"])
    out["stats"] = res["stats"]
    out["nonfinite"] = _nonfinite_report(found, res["dropped"])
    return out


def _passthrough(traj: dict) -> dict:
    """The trajectory fields the update consumes unchanged (and the rollout's `weight_version`, when known)."""
    return {k: traj[k] for k in traj if k in tj.PASSTHROUGH or k == tj.Meta.WEIGHT_VERSION or tj.is_extra(k)}


EMA_VERSION = "ema:{}"  # the version of the averaged weights of weight version v (a replica reloads on a change)


@dataclass
class Actor:
    """The trainer's resident state: policy, optimizer, weight version, and with `algorithm.ema_decay` > 0 the
    exponential moving average of the policy's state dict (`ema`: CPU float32 copies, key for key)."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    version: int = 0
    ema: dict | None = None

    def weights(self) -> dict:
        """Versioned weights for rollout replicas: {"version": int, "state_dict": CPU tensors} (copied off the
        actor's device, so replicas and checkpoints never hold references into it)."""
        return {"version": self.version,
                "state_dict": {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}}

    def eval_weights(self) -> dict:
        """The weights evals and exports use: the average {"version": "ema:<v>", "state_dict": copies} when kept
        (its own version, so a replica that held the trained weights of v reloads, and back), else `weights()`."""
        if self.ema is None:
            return self.weights()
        return {"version": EMA_VERSION.format(self.version),
                "state_dict": {k: v.clone() for k, v in self.ema.items()}}


def ema_start(cfg: Config, actor: Actor, saved: dict | None = None) -> None:
    """Start the actor's average (`algorithm.ema_decay` > 0; else none): from `saved` (a checkpoint's
    `policy_ema`), else from the policy's current weights (the run's initial weights, or those a lost actor is
    rebuilt from)."""
    if not cfg.algorithm.ema_decay:
        actor.ema = None
        return
    src = saved if saved is not None else actor.policy.state_dict()
    actor.ema = {k: v.detach().to("cpu", copy=True) for k, v in src.items()}


@torch.no_grad()
def ema_update_(ema: dict, state: dict, decay: float) -> dict:
    """In place, key for key: ema <- decay * ema + (1 - decay) * state for floating-point entries (buffers
    included), a copy for the others (step counters); `state` is moved to `ema`'s device and dtype. Computed as
    a lerp, so an entry equal in both (a frozen parameter) stays bit for bit. Returns `ema`.
    Polyak averaging as an exponential moving average (openpi's `ema_decay`)."""
    for k, v in state.items():
        e = ema[k]
        v = v.detach().to(e.device)
        if e.is_floating_point():
            e.lerp_(v.to(e.dtype), 1.0 - decay)
        else:
            e.copy_(v)
    return ema


def ema_step(actor: Actor, decay: float) -> None:
    """One step of the actor's average after an update (`ema_update_` with the policy's state dict; the average
    lives on CPU in the policy's dtypes whatever the actor's device). No-op without one."""
    if actor.ema is not None:
        ema_update_(actor.ema, actor.policy.state_dict(), decay)


def _build_actor(cfg: Config, obs_dim: int, action_dim: int, load: bool = True) -> Actor:
    """The actor on `policy.device` (tasks.device.policy_device), float32 master weights (bf16 is autocast)."""
    policy = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg),
                         seed=seeding.model_init_seed(cfg.seed), image_size=image_size(cfg), load=load)
    policy.to(policy_device(cfg))
    return Actor(policy, make_optimizer(cfg, policy))


def to_actor_device(data: dict[str, torch.Tensor], policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A flattened batch (`_flatten`) on the device of the policy's parameters (a no-op on the CPU)."""
    return to_device(data, next(policy.parameters()).device)


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


def actor_init(cfg: Config, run_id: str, dims: tuple[int, int], checkpoint: dict | None = None) -> dict:
    """Create the resident actor for env dims (obs_dim, action_dim): fresh (seeded by `cfg.seed`) or from a
    loaded checkpoint dict with keys `policy`, `optimizer`, `run.weight_version`; return its versioned weights."""
    torch.manual_seed(seeding.model_init_seed(cfg.seed))
    actor = _build_actor(cfg, *dims, load=checkpoint is None)  # a checkpoint overrides policy.model_path
    if checkpoint is None:
        from tasks.demo_index import set_demo_stats
        set_demo_stats(cfg, actor.policy)  # q01 / q99, state standardisation from sft.store (SFT from scratch)
    if checkpoint is not None:
        actor.policy.load_state_dict(checkpoint["policy"])
        load_optimizer_state(actor.policy, actor.optimizer, checkpoint["optimizer"])  # either format (1 or R ranks)
        actor.version = int(checkpoint["run"]["weight_version"])
        _restore_rng(checkpoint)
    # the average continues from the checkpoint's; a checkpoint without one (a run resumed with ema_decay > 0 is
    # refused when its params differ: this is a new run starting from another run's checkpoint) starts it here
    ema_start(cfg, actor, (checkpoint or {}).get("policy_ema"))
    resident.put(f"{run_id}/actor", actor)
    return actor.weights()


class ActorMissing(RuntimeError):
    """The run's actor is not resident on the worker asked for it (that worker process was restarted since the
    actor was built or restored there: its weights and optimizer state are gone)."""


def actor_eval_weights(run_id: str, weights: dict) -> dict:
    """The weights an eval plays (`Actor.eval_weights`: the average with `algorithm.ema_decay` > 0), read on the
    actor's worker; `weights` (the step's versioned weights, a graph dependency) only orders this after the
    update that made them.

    Raises ActorMissing when this worker holds no actor of the run (the average is lost with it)."""
    actor: Actor = resident.get(f"{run_id}/actor")
    if actor is None:
        raise ActorMissing(f"no resident actor for run {run_id} on this worker")
    return actor.eval_weights()


def actor_state(run_id: str) -> dict:
    """Policy and optimizer state of the resident actor, for a checkpoint (CPU tensors; the optimizer in the
    FQN-keyed format of `optimizer_state`, the same as the multi-rank update's; `policy_ema`: the average, when
    kept).

    Raises ActorMissing when this worker holds no actor of the run."""
    actor: Actor = resident.get(f"{run_id}/actor")
    if actor is None:
        raise ActorMissing(f"no resident actor for run {run_id} on this worker")
    state = {"policy": {k: v.detach().to("cpu", copy=True) for k, v in actor.policy.state_dict().items()},
             "optimizer": optimizer_state(actor.policy, actor.optimizer),
             "rng_torch": torch.get_rng_state(), "rng": _rng_state(), "weight_version": actor.version}
    if actor.ema is not None:
        state["policy_ema"] = {k: v.clone() for k, v in actor.ema.items()}
    return state


def _rng_state() -> dict:
    """This process's torch/numpy/python RNG states, checkpoint-loadable (storage.checkpoints.rng_state)."""
    from storage.checkpoints import rng_state
    return rng_state()


def _restore_rng(checkpoint: dict) -> None:
    """Continue the actor process's RNG streams where the checkpoint's process left them (exact resume: the
    actor's worker also draws the disaggregated policy_infer's exploration noise). Checkpoints from before
    `rng` was saved restore the torch state (`rng_torch`) only."""
    from storage.checkpoints import set_rng_state
    if checkpoint.get("rng") is not None:
        set_rng_state(checkpoint["rng"])
    elif checkpoint.get("rng_torch") is not None:
        torch.set_rng_state(checkpoint["rng_torch"])


def write_export(policy: torch.nn.Module, final: str, env_meta: dict | None = None) -> str:
    """Write `policy` in the `save_pretrained` layout to the directory `final` (the one `policy.model_path` takes):
    to a sibling tmp dir first, then renamed over `final`. `env_meta` (simulator, env_id, control_mode,
    gripper_convention: pipelines.graphs.export_env_meta) is added to its config.json as `env`;
    `dagrl_files.json` (storage.checkpoints.index_export, written last) lists every file's size and sha256, so a
    damaged copy is refused offline (pipelines.config.check_model_path). Returns `final`."""
    import json
    import os
    import shutil
    from storage.checkpoints import index_export
    final = os.fspath(final)
    tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    if env_meta:
        conf = os.path.join(tmp, "config.json")
        meta = json.loads(open(conf).read())
        meta["env"] = dict(env_meta)
        with open(conf, "w") as f:
            f.write(json.dumps(meta, indent=2, sort_keys=True))
    index_export(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def actor_export(run_id: str, checkpoint_path: str, env_meta: dict | None = None) -> str | None:
    """Write the resident actor's policy to `<checkpoint_path>/hf` (:func:`write_export`; policies that have a
    `save_pretrained`: the VLAs), its averaged weights when kept (`algorithm.ema_decay`). Returns the directory,
    or None without an actor or such a policy."""
    import os
    actor: Actor = resident.get(f"{run_id}/actor")
    if actor is None or not hasattr(actor.policy, "save_pretrained"):
        return None
    policy = actor.policy
    if actor.ema is not None:  # the export is what the evals scored: the average, in a copy of the module
        import copy
        policy = copy.deepcopy(policy).to("cpu")
        policy.load_state_dict(actor.ema)
    return write_export(policy, os.path.join(checkpoint_path, "hf"), env_meta)


def _flatten(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate shards along B, then [T, B, ...] -> [T*B, ...] (SAMPLE_FIELDS, rgb, extras/*)."""
    out = {}
    for k in [k for k in samples[0] if tj.is_sample_field(k)]:
        x = np.concatenate([s[k] for s in samples], axis=1)  # [T, B_total, ...]
        out[k] = torch.from_numpy(x.reshape(-1, *x.shape[2:]))  # [T, B, ...] -> [N, ...]
    return out


def batch_obs(policy: torch.nn.Module, data: dict[str, torch.Tensor], idx: torch.Tensor, instr) -> dict:
    """The policy's observation dict for samples `idx` of a flattened batch (state, rgb, prompt), on the batch's
    device (the cached prompt tokens live on the CPU). `instr`: the run's instruction table (or one string);
    each sample's prompt is the table's row at its stored `task_id` (the prompt its rollout used; task 0 for a
    batch without the field)."""
    task = data["task_id"][idx] if "task_id" in data else None
    obs = policy_obs(policy, data["obs"][idx], data["rgb"][idx] if "rgb" in data else None, instr, task)
    return to_device(obs, data["obs"].device)


def batch_extras(data: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k[len(tj.EXTRAS_PREFIX):]: v[idx] for k, v in data.items() if tj.is_extra(k)}


LOSS_METRICS = ("actor_loss", "critic_loss", "entropy", "approx_kl", "clipfrac", "ratio_mean", "explained_variance",
                "loss")
TERM_METRICS = LOSS_METRICS[:-1]  # the loss terms; "loss" (last) is the micro-batch's share-weighted loss itself
VALUE_METRICS = ("critic_loss", "explained_variance")  # weighted by the value mask's share, the rest by lp_mask's


def prepare_update(cfg: Config, data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """Per-sample tensors of the PPO loss for a flattened batch (`_flatten`), computed once per update.

    Returns `step_mask` [N, C] bool (GRPO masks steps after the first done), `old_lp` (old log-probs reduced to
    `logprob_type`: [N], [N, C] or [N, C, D]), `lp_mask` (same shape, bool), `adv` (normalised over the whole batch
    when the estimator's normalisation is "batch" and algorithm.normalize_advantages, expanded to the log-prob
    shape), `returns` and `old_values` ([N] or [N, C]), `v_mask` (same shape, bool) and `critic` (the estimator
    trains a critic: EstimatorSpec.critic). With algorithm.actor_loss=filtered_bc also `bc_mask` [N, C] bool (the
    executed actions of the samples whose advantage, normalised as above, is > 0), and `lp_mask` is that mask at the
    log-probs' granularity (the shares of `update_epochs` then count the imitated actions).

    Raises:
        ValueError: a non-finite advantage inside the loss mask (normalize_advantages; `advantages` drops them
            first with algorithm.nonfinite=mask, and raises NonFiniteError with =error).
    """
    a, C = cfg.algorithm, cfg.policy.num_action_chunks
    spec = get_estimator(a.name).spec
    D = data["actions"].shape[-1]
    step_mask = data["step_mask"] & data["loss_mask"][:, None]  # [N, C]; GRPO masks steps after the first done
    old_lp = reduce_logprobs(data["logprobs"], step_mask=step_mask, logprob_type=a.logprob_type)
    lp_mask = loss_mask_for(step_mask, logprob_type=a.logprob_type, action_dim=D)
    adv = data["advantages"]  # [N] or [N, C]
    adv_mask = step_mask.any(-1) if adv.dim() == 1 else step_mask
    if a.normalize_advantages and spec.normalisation == "batch":  # global ("group": normalised by the estimator)
        adv = normalize_advantages(adv, adv_mask)
    pos = (adv > 0)[:, None] if adv.dim() == 1 else adv > 0  # [N, 1] or [N, C]: filtered_bc's filter
    adv = expand_advantages(adv, logprob_type=a.logprob_type, num_action_chunks=C, action_dim=D)
    old_values = data["values"] if num_values(cfg) > 1 else data["values"][:, 0]  # [N, V] -> [N] or [N, C]
    prep = {"step_mask": step_mask, "old_lp": old_lp, "lp_mask": lp_mask, "adv": adv, "returns": data["returns"],
            "old_values": old_values, "v_mask": adv_mask, "critic": spec.critic}
    if a.actor_loss == "filtered_bc":  # the executed actions whose advantage (as the ppo loss weights it) is > 0
        prep["bc_mask"] = step_mask & pos  # [N, C]
        # the shares of update_epochs count the BC mask's entries (at the log-probs' granularity)
        prep["lp_mask"] = loss_mask_for(prep["bc_mask"], logprob_type=a.logprob_type, action_dim=D)
    return prep


def minibatch_loss(cfg: Config, policy: torch.nn.Module, data: dict[str, torch.Tensor], prep: dict,
                   idx: torch.Tensor, instr) -> dict[str, torch.Tensor]:
    """PPO loss terms on samples `idx` (int64 [n]) of a flattened batch: one forward of `policy.evaluate`.

    With `prep["prox_lp"]` set (a stale rollout, `proximal_logprobs`), the decoupled PPO loss: ratio against the
    proximal log-probs, weighted by proximal / behaviour (`tasks.algorithms.decoupled_ppo_actor_loss`).

    Returns 0-d tensors: `actor_loss`, `critic_loss` (0 without a critic), `entropy` (differentiable token-means
    over `lp_mask[idx]` / `v_mask[idx]`), `loss` = actor_loss + value_coef * critic_loss - entropy_coef * entropy
    (differentiable; value_coef * critic_loss only with `prep["critic_only"]`), and the metrics `approx_kl`,
    `clipfrac`, `ratio_mean` (token-means over `lp_mask[idx]`), `explained_variance`.
    """
    a = cfg.algorithm
    step_mask, lp_mask = prep["step_mask"], prep["lp_mask"]
    if a.actor_loss == "filtered_bc":
        return _filtered_bc_loss(cfg, policy, data, prep, idx, instr)
    out = policy.evaluate(batch_obs(policy, data, idx, instr), data["actions"][idx], batch_extras(data, idx))
    new_lp = reduce_logprobs(out["logprobs"], step_mask=step_mask[idx], logprob_type=a.logprob_type)
    if prep.get("prox_lp") is None:  # on-policy: proximal = behaviour log-probs, plain PPO
        pl = ppo_actor_loss(logprobs=new_lp, old_logprobs=prep["old_lp"][idx], advantages=prep["adv"][idx],
                            loss_mask=lp_mask[idx], clip_ratio_low=a.clip_ratio_low,
                            clip_ratio_high=a.clip_ratio_high, dual_clip=a.dual_clip)
    else:  # a stale rollout (runner.max_staleness > 0): decoupled PPO around the update's starting weights
        pl = decoupled_ppo_actor_loss(logprobs=new_lp, proximal_logprobs=prep["prox_lp"][idx],
                                      behaviour_logprobs=prep["old_lp"][idx], advantages=prep["adv"][idx],
                                      loss_mask=lp_mask[idx], clip_ratio_low=a.clip_ratio_low,
                                      clip_ratio_high=a.clip_ratio_high, dual_clip=a.dual_clip)
    vl = critic_loss(values=out["values"], returns=prep["returns"][idx], loss_mask=prep["v_mask"][idx],
                     value_clip=a.value_clip, old_values=prep["old_values"][idx]) if prep["critic"] else \
        {"loss": torch.zeros(()), "explained_variance": torch.zeros(())}
    ent = entropy_bonus(reduce_logprobs(out["entropy"], step_mask=step_mask[idx],
                                        logprob_type=a.logprob_type), lp_mask[idx])
    if prep.get("critic_only"):  # critic warm-up: the policy is not updated yet
        loss = a.value_coef * vl["loss"]
    else:
        loss = pl["loss"] + a.value_coef * vl["loss"] - a.entropy_coef * ent
    return {"actor_loss": pl["loss"], "critic_loss": vl["loss"], "entropy": ent, "approx_kl": pl["approx_kl"],
            "clipfrac": pl["clipfrac"], "ratio_mean": pl["ratio_mean"],
            "explained_variance": vl["explained_variance"], "loss": loss}


def _filtered_bc_loss(cfg: Config, policy: torch.nn.Module, data: dict[str, torch.Tensor], prep: dict,
                      idx: torch.Tensor, instr) -> dict[str, torch.Tensor]:
    """`minibatch_loss` for algorithm.actor_loss=filtered_bc: `policy.sft_loss` on the samples' stored actions over
    `prep["bc_mask"][idx]` (executed actions of chunk steps with advantage > 0) as `actor_loss`, plus the critic's
    loss as with ppo. No log-prob ratio is formed, so `approx_kl`, `clipfrac` and `ratio_mean` are 0 and the
    entropy term is 0 (not computed)."""
    a = cfg.algorithm
    rows = idx[prep["bc_mask"][idx].any(-1)]  # only the samples with an imitated action go through the policy
    zero = torch.zeros((), device=data["obs"].device)
    bc = policy.sft_loss(batch_obs(policy, data, rows, instr), data["actions"][rows],
                         mask=prep["bc_mask"][rows]) if len(rows) else zero
    if prep["critic"]:
        obs = batch_obs(policy, data, idx, instr)
        old_values = prep["old_values"][idx]  # [n] or [n, C]
        vl = critic_loss(values=policy.values(obs).reshape(old_values.shape), returns=prep["returns"][idx],
                         loss_mask=prep["v_mask"][idx], value_clip=a.value_clip, old_values=old_values)
    else:
        vl = {"loss": zero, "explained_variance": zero}
    loss = a.value_coef * vl["loss"] if prep.get("critic_only") else bc + a.value_coef * vl["loss"]
    return {"actor_loss": bc, "critic_loss": vl["loss"], "entropy": zero, "approx_kl": zero, "clipfrac": zero,
            "ratio_mean": zero, "explained_variance": vl["explained_variance"], "loss": loss}


def proximal_logprobs(cfg: Config, policy: torch.nn.Module, data: dict[str, torch.Tensor], prep: dict,
                      instr) -> torch.Tensor:
    """Log-probs of the batch's actions under `policy` as it is now (before the update's first minibatch),
    reduced like `prep["old_lp"]` (same shape); no grad, in minibatch-sized chunks, in the policy's current mode.
    These are decoupled PPO's proximal log-probs (the trust region's centre) for a rollout made with older weights."""
    N = data["actions"].shape[0]
    chunk = max(1, N // cfg.algorithm.num_minibatches)
    parts = []
    dev = data["obs"].device
    with torch.no_grad(), autocast(cfg.policy.dtype, dev):
        for start in range(0, N, chunk):
            idx = torch.arange(start, min(N, start + chunk))
            out = policy.evaluate(batch_obs(policy, data, idx, instr), data["actions"][idx], batch_extras(data, idx))
            parts.append(reduce_logprobs(out["logprobs"], step_mask=prep["step_mask"][idx],
                                         logprob_type=cfg.algorithm.logprob_type))
    return torch.cat(parts)


def behaviour_version(weights: dict, samples: tuple[dict, ...]) -> int:
    """The oldest weight version the samples were rolled out with (`weights`' version when they do not say)."""
    return min(int(s.get(tj.Meta.WEIGHT_VERSION, weights["version"])) for s in samples)


# ---------------------------------------------------------------- randomness of the update (module docstring)
def permutation_seed(cfg: Config, version: int) -> int:
    """Seed of the minibatch permutations of the update on weights `version` (identical on every rank):
    `tasks.seeding.permutation_seed(cfg.seed, version)`."""
    return seeding.permutation_seed(cfg.seed, version)


def update_seed(cfg: Config, version: int, rank: int = 0) -> int:
    """Seed of the default torch generators inside the update on weights `version` at `rank` (`update_rng`):
    `tasks.seeding.update_seed(cfg.seed, version, rank)`."""
    return seeding.update_seed(cfg.seed, version, rank)


@contextlib.contextmanager
def update_rng(cfg: Config, version: int, rank: int = 0, device: torch.device | str = "cpu"):
    """Fork the CPU generator (and `device`'s, on CUDA) and seed them with `update_seed(cfg, version, rank)`;
    on exit the process's streams are as they were before (torch.random.fork_rng)."""
    device = torch.device(device)
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with seeding.forked(update_seed(cfg, version, rank), cuda):
        yield


# ---------------------------------------------------------------- the update loop (1 or R ranks)
def _share(mask: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """mask.sum() / total as a float 0-d tensor; 0 when total is 0."""
    n = mask.sum().to(torch.float32)
    return torch.where(total > 0, n / total.clamp(min=1), torch.zeros_like(n))


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


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


def update_epochs(cfg: Config, policy: torch.nn.Module, opt: torch.optim.Optimizer, data: dict, prep: dict,
                  instr, plan, gen: torch.Generator, *, rank: int = 0, world: int = 1,
                  all_reduce=_no_reduce) -> tuple[dict[str, float], dict[str, int]]:
    """The update epochs on this rank (1 rank: world=1, no collective); every rank must call it together.

    Each epoch draws one permutation of the N samples from `gen` (the same on every rank); optimizer step i takes
    the global minibatch perm[i*G:(i+1)*G], this rank its slice [rank*P, (rank+1)*P) and micro-batches of M
    (`plan`: tasks.distributed.BatchPlan). A micro-batch's loss terms are weighted by its share of the minibatch's
    mask count (over all ranks), so the summed gradient is the minibatch's token-mean loss whatever the split; x
    world because FSDP averages gradients over ranks. Critic warm-up (`prep["critic_only"]`): value_coef *
    critic_loss only. Metric sums (share-weighted) and a count of non-finite micro-batch losses are all-reduced
    once per step, so every rank takes the same decisions: skip the step if that count or the global gradient
    norm is non-finite (no optimizer.step: parameters and optimizer state unchanged), stop at target_kl.
    A minibatch with an empty mask is not stepped.

    Returns (metric sums over the applied steps: LOSS_METRICS + grad_norm, counts {"applied", "skipped", "empty",
    "epochs"}).
    """
    a = cfg.algorithm
    device = data["obs"].device
    N = data["actions"].shape[0]
    G, P, M = plan.global_batch_size, plan.per_rank_batch_size, plan.micro_batch_size
    lp_mask, v_mask = prep["lp_mask"], prep["v_mask"]
    critic_only, critic = bool(prep.get("critic_only")), bool(prep["critic"])
    grad_sync = getattr(policy, "set_requires_gradient_sync", None)  # FSDP2: reduce-scatter on the last micro-batch
    K = len(LOSS_METRICS)
    sums: dict[str, float] = {}
    counts = {"applied": 0, "skipped": 0, "empty": 0, "epochs": 0}
    stop = False
    for _ in range(a.update_epochs):
        perm = torch.randperm(N, generator=gen)
        for i in range(plan.num_minibatches):
            mb = perm[i * G:(i + 1) * G].to(device)  # the global minibatch [G]
            mine = mb[rank * P:(rank + 1) * P]  # this rank's slice [P]
            n_lp = lp_mask[mb].sum().to(torch.float32)  # mask counts over the whole minibatch (all ranks)
            n_v = v_mask[mb].sum().to(torch.float32)
            n_active = n_v if critic_only else n_lp + (n_v if critic else 0)
            if not bool(n_active > 0):  # nothing to learn from (all ranks see the same masks): no step
                counts["empty"] += 1
                continue
            opt.zero_grad(set_to_none=True)
            local = torch.zeros(K + 1, dtype=torch.float64, device=device)  # [K metrics, non-finite losses]
            for j in range(plan.grad_accum):
                idx = mine[j * M:(j + 1) * M]  # micro-batch [M]
                if grad_sync is not None:
                    grad_sync(j == plan.grad_accum - 1)
                with autocast(cfg.policy.dtype, device):
                    terms = minibatch_loss(cfg, policy, data, prep, idx, instr)
                s_lp, s_v = _share(lp_mask[idx], n_lp), _share(v_mask[idx], n_v)
                if critic_only:  # critic warm-up: the actor's terms do not enter the loss
                    share_loss = a.value_coef * s_v * terms["critic_loss"]
                else:
                    share_loss = (s_lp * terms["actor_loss"] + a.value_coef * s_v * terms["critic_loss"]
                                  - a.entropy_coef * s_lp * terms["entropy"])
                (share_loss * world).backward()  # FSDP averages over ranks; x world makes it the minibatch's sum
                with torch.no_grad():  # one add: the share-weighted terms, the share loss, a non-finite count
                    sl = share_loss.detach().to(torch.float64)
                    vals = torch.stack([torch.as_tensor(terms[n]).to(device, torch.float64) for n in TERM_METRICS])
                    shares = torch.stack([s_v if n in VALUE_METRICS else s_lp for n in TERM_METRICS])
                    local += torch.cat([vals * shares.to(torch.float64), sl[None],
                                        (~torch.isfinite(sl)).to(sl.dtype)[None]])
            all_reduce(local)  # SUM over ranks: the minibatch's token-means, identical on all ranks
            applied, (gn,) = optimizer_step(opt, [list(policy.parameters())], a.max_grad_norm,
                                            loss_finite=float(local[K]) == 0)  # on every rank alike
            if not applied:
                counts["skipped"] += 1
                continue
            counts["applied"] += 1
            for k, name in enumerate(LOSS_METRICS):
                sums[name] = sums.get(name, 0.0) + float(local[k])
            sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(gn)
            if a.target_kl is not None and float(local[LOSS_METRICS.index("approx_kl")]) > a.target_kl:
                stop = True
                break
        counts["epochs"] += 1
        if stop:
            break
    return sums, counts


def nonfinite_metrics(samples: tuple[dict, ...]) -> dict[str, float]:
    """`rollout/nonfinite_<field>` summed over the shards' `advantages` outputs (their "nonfinite" counts)."""
    out: dict[str, float] = {}
    for s in samples:
        for k, v in (s.get("nonfinite") or {}).items():
            out[f"rollout/nonfinite_{k}"] = out.get(f"rollout/nonfinite_{k}", 0.0) + float(v)
    return out


def run_update(cfg: Config, policy: torch.nn.Module, opt: torch.optim.Optimizer, data: dict, *, version: int,
               behaviour: int, plan, rank: int = 0, world: int = 1, all_reduce=_no_reduce) -> dict[str, float]:
    """One PPO/GRPO update of `policy` on a flattened batch `data` (on the policy's device): THE loop for one rank
    (world=1) and for every rank of a process group (`all_reduce` = torch.distributed.all_reduce).

    version: the weight version the update starts from (critic warm-up: version < algorithm.critic_warmup_steps;
        the seeds of the module docstring's randomness rule). behaviour: the oldest version the samples were
        rolled out with; < version recomputes the proximal log-probs (decoupled PPO).

    Returns train/* metrics: LOSS_METRICS and grad_norm (means over applied steps; NaN when none), epochs_run,
    minibatch_updates (applied steps), skipped_updates (non-finite loss or gradient), empty_minibatches,
    critic_only, lr, behaviour_logprob_mean, proximal_logprob_mean.
    """
    import warnings

    a = cfg.algorithm
    instr = instructions(cfg)  # the per-sample prompts: this table at each sample's task_id
    device = data["obs"].device
    with update_rng(cfg, version, rank, device), warnings.catch_warnings():
        # FSDP2: evaluate() returns views (values.squeeze); none is edited in place
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        prep = prepare_update(cfg, data)
        # critic warm-up (PPO): the first `critic_warmup_steps` updates train the value head only
        prep["critic_only"] = prep["critic"] and int(version) < a.critic_warmup_steps
        policy.train()
        if behaviour < int(version) and a.actor_loss == "ppo":  # filtered_bc forms no ratio: nothing to centre
            prep["prox_lp"] = proximal_logprobs(cfg, policy, data, prep, instr)
        lp_stats = {"train/behaviour_logprob_mean": float(masked_mean(prep["old_lp"], prep["lp_mask"])),
                    "train/proximal_logprob_mean": float(masked_mean(
                        prep["old_lp"] if prep.get("prox_lp") is None else prep["prox_lp"], prep["lp_mask"]))}
        set_annealed_lr(a, opt, int(version))
        gen = torch.Generator().manual_seed(permutation_seed(cfg, version))
        try:
            sums, counts = update_epochs(cfg, policy, opt, data, prep, instr, plan, gen, rank=rank, world=world,
                                         all_reduce=all_reduce)
        finally:
            policy.eval()
    n = counts["applied"]
    metrics = {f"train/{k}": (sums[k] / n if n else math.nan) for k in (*LOSS_METRICS, "grad_norm")}
    metrics.update({"train/epochs_run": float(counts["epochs"]), "train/minibatch_updates": float(n),
                    "train/skipped_updates": float(counts["skipped"]),
                    "train/empty_minibatches": float(counts["empty"]),
                    "train/critic_only": float(prep["critic_only"]), "train/lr": opt.param_groups[0]["lr"],
                    **lp_stats})
    if "bc_mask" in prep:  # filtered_bc: the share of the executed actions it imitates
        metrics["train/bc_kept_fraction"] = float(prep["bc_mask"].sum() / prep["step_mask"].sum().clamp(min=1))
    return metrics


def one_rank_plan(cfg: Config, N: int):
    """The batch plan of the one-rank update: num_minibatches optimizer steps of N // num_minibatches samples per
    epoch, no gradient accumulation (tasks.distributed.check_batch_sizes)."""
    from tasks.config import check_batch_sizes
    nm = cfg.algorithm.num_minibatches
    G = max(N // nm, 1)
    return check_batch_sizes(G * min(nm, N // G), 1, G, G)  # N % num_minibatches samples are never drawn, as before


def actor_update(cfg: Config, run_id: str, weights: dict, *samples: dict) -> dict:
    """PPO update on the samples of every shard; returns new versioned weights and metrics (`run_update`: the
    same loop as the multi-rank update, as a world of one).

    `weights` are the actor's current weights (version v): the rollout's own with synchronous steps, the previous
    update's output with `runner.max_staleness` > 0. If the resident actor is missing (a fresh worker after a
    loss), it is rebuilt from them with a fresh optimizer and `train/actor_rebuilt` = 1 is reported.

    When the samples were rolled out with an older version than v (their `weight_version`), the proximal
    log-probs are recomputed under the current weights before the first minibatch and the decoupled PPO loss is
    used; otherwise proximal = behaviour and the loss is plain PPO (bit-identical to synchronous steps).
    Logged: `train/behaviour_logprob_mean`, `train/proximal_logprob_mean` (masked means), the counts of the
    module docstring (`train/skipped_updates`, `train/empty_minibatches`, `rollout/nonfinite_*`).
    """
    t0 = time.perf_counter()
    data = _flatten(samples)
    N, D = data["actions"].shape[0], data["actions"].shape[-1]
    rebuilt = 0.0

    def rebuild() -> Actor:
        actor = _build_actor(cfg, data["obs"].shape[-1], D, load=False)
        actor.policy.load_state_dict(weights["state_dict"])
        actor.version = weights["version"]
        return actor

    actor, created = resident.get_or_create(f"{run_id}/actor", rebuild)
    if created:
        rebuilt = 1.0
        ema_start(cfg, actor)  # the lost average restarts from the weights the actor is rebuilt from
    data = to_actor_device(data, actor.policy)
    metrics = run_update(cfg, actor.policy, actor.optimizer, data, version=int(weights["version"]),
                         behaviour=behaviour_version(weights, samples), plan=one_rank_plan(cfg, N))
    ema_step(actor, cfg.algorithm.ema_decay)
    actor.version = weights["version"] + 1
    metrics.update({"train/actor_rebuilt": rebuilt, "train/weight_version": float(actor.version),
                    "time/update": time.perf_counter() - t0, **nonfinite_metrics(samples)})
    out = actor.weights()
    out["metrics"] = metrics
    return out

def actor_update_offload(cfg, run_id: str, weights: dict, *samples: dict) -> dict:
    """`tasks.update.actor_update` between an onload and an offload of the resident actor (algorithm.offload).

    The actor's compute device is recorded on first use (`{run_id}/actor_device`: where `actor_update` trains
    it); before the update the actor is moved there, after it back to CPU memory. Adds the metrics of the module
    docstring to the update's output.
    """
    from tasks.offload import module_device, offload, onload
    key = f"{run_id}/actor"
    actor = resident.get(key)
    onload_s = 0.0
    if actor is not None:
        home = resident.get(f"{run_id}/actor_device") or module_device(actor.policy)
        resident.put(f"{run_id}/actor_device", home)
        onload_s = onload(actor.policy, actor.optimizer, home)
    out = actor_update(cfg, run_id, weights, *samples)
    actor = resident.get(key)  # actor_update may have rebuilt it
    home = resident.get(f"{run_id}/actor_device") or module_device(actor.policy)
    resident.put(f"{run_id}/actor_device", home)
    res = offload(actor.policy, actor.optimizer, home)
    m = out["metrics"]
    m["time/offload"] = onload_s + res["seconds"]
    m["system/actor_device_mb_before_offload"] = res["device_mb_before"]
    m["system/actor_device_mb_after_offload"] = res["device_mb_after"]
    for k in ("cuda_allocated_mb_before", "cuda_allocated_mb_after"):
        if k in res:
            m[f"system/{k}_offload"] = res[k]
    return out
