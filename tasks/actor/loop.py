"""THE update loop of the actor, for one rank (a world of size 1, no collective: tasks.actor.entries.actor_update)
and R ranks (`torch.distributed.all_reduce`: tasks.actor.distributed.actor_update_rank): batching, the losses' use,
critic warm-up, skipping non-finite steps, the loss weighting, target_kl, metrics and the randomness rule exist once.

Flattening: a trajectory's [T, B, ...] fields become [N = T*B, ...] samples for the update. With
`reward_type=chunk_level` advantages/returns are [N]; with `action_level` they are [N, C] and values [N, C].

The update (both `algorithm.nonfinite` modes): an optimizer step whose loss or gradient norm is non-finite on any
rank is skipped (no `optimizer.step`: parameters and optimizer state stay bit-identical), counted in
`train/skipped_updates`; a minibatch with an empty loss mask is not stepped either (Adam would move the weights on a
zero gradient through its momentum), counted in `train/empty_minibatches`. train/* loss metrics are means over the
applied steps (NaN when none was applied: MLflow shows it).

Randomness (exact resume without saved update state): every draw of the update on weights version v is a function
of (cfg.seed, v, rank) only (the formulas: tasks.seeding). Minibatch permutations come from
`torch.Generator().manual_seed(permutation_seed(cfg, v))` (identical on every rank, each rank takes its slice); any
other torch draw inside the update (a policy's sampling in its loss, e.g. the flow VLA's `sft_loss`) comes from the
default generators forked for the update (`update_rng`) and seeded with `update_seed(cfg, v, rank)`, so the
process's own streams (rollout sampling on the same worker) are neither consumed nor changed by an update. The step
counters that schedule anything in the update (critic warm-up: `algorithm.critic_warmup_steps` against v) come from
the weight version, which the checkpoint carries (`run.weight_version`); the learning rates are the optimizer's
param_groups, saved with it (tasks.actor.state).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from tasks import seeding
from tasks import trajectory as tj
from tasks.actor.optim import optimizer_step, set_annealed_lr
from tasks.algorithms import (critic_loss, decoupled_ppo_actor_loss, entropy_bonus, expand_advantages,
                              get_estimator, loss_mask_for, masked_mean, normalize_advantages, ppo_actor_loss,
                              reduce_logprobs)
from tasks.config import Config
from tasks.device import autocast, to_device
from tasks.prompts import instructions, policy_obs
from tasks.rollout import num_values

SAMPLE_FIELDS = tj.SAMPLE_FIELDS  # the update's samples (tasks.trajectory: the `update` fields), extras/* on top


def to_actor_device(data: dict[str, torch.Tensor], policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A flattened batch (`flatten`) on the device of the policy's parameters (a no-op on the CPU)."""
    return to_device(data, next(policy.parameters()).device)


def flatten(samples: list[dict]) -> dict[str, torch.Tensor]:
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
    """Per-sample tensors of the PPO loss for a flattened batch (`flatten`), computed once per update.

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


def update_epochs(cfg: Config, policy: torch.nn.Module, opt: torch.optim.Optimizer, data: dict, prep: dict,
                  instr, plan, gen: torch.Generator, *, rank: int = 0, world: int = 1,
                  all_reduce=_no_reduce) -> tuple[dict[str, float], dict[str, int]]:
    """The update epochs on this rank (1 rank: world=1, no collective); every rank must call it together.

    Each epoch draws one permutation of the N samples from `gen` (the same on every rank); optimizer step i takes
    the global minibatch perm[i*G:(i+1)*G], this rank its slice [rank*P, (rank+1)*P) and micro-batches of M
    (`plan`: tasks.config.BatchPlan). A micro-batch's loss terms are weighted by its share of the minibatch's
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
    """The batch plan of the one-rank update: num_minibatches optimizer steps of G = N // num_minibatches samples
    per epoch, each in micro-batches of `algorithm.micro_batch_size` samples with the gradients accumulated
    (`update_epochs`: the same step up to float summation order), or one micro-batch of G when it is None. A
    micro-batch size that does not divide G (N smaller than the configured batch) becomes their gcd: never more
    samples per forward/backward than asked (tasks.config.check_batch_sizes)."""
    import math

    from tasks.config import check_batch_sizes
    nm, M = cfg.algorithm.num_minibatches, cfg.algorithm.micro_batch_size
    G = max(N // nm, 1)
    M = G if M is None else math.gcd(G, min(M, G))
    return check_batch_sizes(G * min(nm, N // G), 1, G, M)  # N % num_minibatches samples are never drawn, as before
