"""PPO policy/value losses with masks and named reductions.

Every loss takes a ``loss_mask`` of the same shape as its per-element terms (bool or float weights) and
a named ``reduction``:

* ``token-mean``: masked mean over all elements (verl ``agg_loss(loss_agg_mode="token-mean")``).
* ``seq-mean``: per-row masked mean over all but the leading dim, then the mean over rows that have at
  least one unmasked element (verl ``seq-mean-token-mean``, without its NaN on empty rows).

Losses return dicts of named terms: ``loss`` is a differentiable scalar; the rest are detached 0-d
tensors for logging (no ``.item()``, so no device sync inside the loss).

Non-finite values and degenerate statistics:

* masked-out slots never leak, neither into a value nor into a gradient: reductions use ``where`` (not
  multiplication by the mask), and the constants of a loss (advantages, returns, old values, the log-ratio) are
  set to 0 at masked slots before they meet a differentiable term;
* an empty mask gives 0 for every mean (loss terms and metrics: clipfrac, approx_kl, ratio_mean, entropy), never
  NaN; explained variance is 0 when Var[returns] == 0 (a constant target, a single element, an empty mask);
* a NaN/inf INSIDE the mask propagates to the loss on purpose: the update (``tasks.actor.loop``) detects the
  non-finite loss or gradient and skips that optimizer step; ``normalize_advantages`` raises instead (its
  statistics would spread the NaN to every sample).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tasks.algorithms.ties import is_tie

__all__ = [
    "REDUCTIONS",
    "masked_mean",
    "aggregate_loss",
    "ppo_actor_loss",
    "decoupled_ppo_actor_loss",
    "critic_loss",
    "entropy_bonus",
    "normalize_advantages",
]

REDUCTIONS: tuple[str, ...] = ("token-mean", "seq-mean")


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch (no broadcasting): {shapes}")


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | Sequence[int] | None = None
) -> torch.Tensor:
    """Mean of ``x`` over elements where ``mask`` is set.

    Args:
        x: float tensor, any shape.
        mask: bool or float weights, same shape as ``x`` (ValueError otherwise). Masked-out entries of
            ``x`` are ignored even if they are NaN/inf.
        dim: dims to reduce; None reduces all to a 0-d tensor.
    Returns:
        sum(x * mask) / sum(mask) over ``dim``; 0 where sum(mask) == 0 (never NaN).
    """
    _check_same_shape(x=x, mask=mask)
    if mask.dtype == torch.bool:  # the common case, in 4 ops (it runs ~10x per minibatch): a count clamped to 1
        # equals the general path's safe denominator, and the numerator is 0 wherever the count is 0
        num = torch.where(mask, x, 0.0).sum() if dim is None else torch.where(mask, x, 0.0).sum(dim=dim)
        den = mask.sum() if dim is None else mask.sum(dim=dim)
        return num / den.clamp(min=1).to(num.dtype)
    keep = mask != 0
    weights = mask.to(x.dtype)
    weighted = torch.where(keep, x * weights, torch.zeros_like(x))
    if dim is None:
        num, den = weighted.sum(), weights.sum()
    else:
        num, den = weighted.sum(dim=dim), weights.sum(dim=dim)
    safe_den = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe_den, torch.zeros_like(num))


def aggregate_loss(x: torch.Tensor, mask: torch.Tensor, *, reduction: str = "token-mean") -> torch.Tensor:
    """Reduce per-element terms ``x`` [N, ...] with ``mask`` (same shape) to a scalar.

    ``token-mean``: masked mean over all elements. ``seq-mean``: masked mean of each row ``x[i]``, then
    the mean over rows with a non-zero mask (0 if none). ValueError on an unknown reduction (listing
    the valid ones) or shape mismatch.
    """
    _check_same_shape(x=x, mask=mask)
    if reduction == "token-mean":
        return masked_mean(x, mask)
    if reduction == "seq-mean":
        if x.dim() == 0:
            raise ValueError("reduction 'seq-mean' needs inputs with a leading row dim [N, ...]")
        if x.dim() == 1:
            return masked_mean(x, mask)  # each row is one element: same as token-mean
        dims = tuple(range(1, x.dim()))
        row_means = masked_mean(x, mask, dim=dims)  # [N, ...] -> [N]
        row_has = (mask != 0).flatten(1).any(dim=1)  # [N, ...] -> [N*] -> [N]
        return masked_mean(row_means, row_has)
    raise ValueError(f"unknown reduction {reduction!r}; valid: {list(REDUCTIONS)}")


def ppo_actor_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None = None,
    reduction: str = "token-mean",
) -> dict[str, torch.Tensor]:
    """PPO clipped surrogate loss (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    eq. 7) with separate lower/upper clip ranges (RLinf/verl ``clip_ratio_low``/``clip_ratio_high``)
    and optional dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL").

    All tensors have the same shape (e.g. [N], [N, C] or [N, C, D] per ``logprob_type``; no
    broadcasting: expand advantages first with ``expand_advantages``)::

        ratio = exp(logprobs - old_logprobs)           (log-ratio clamped to [-20, 20] like verl)
        pg    = max(-A * ratio, -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
        pg    = min(pg, -A * dual_clip)   where A < 0   (dual clip, if set; dual_clip > 1)
        loss  = reduction(pg, loss_mask)

    ``old_logprobs`` and ``advantages`` are treated as constants (detached).

    Returns dict: ``loss`` (differentiable scalar), ``clipfrac`` (fraction of masked elements where the
    clipped term is active), ``dual_clipfrac`` (fraction where the dual clip is active; 0 without it),
    ``approx_kl`` (k3 estimator mean((r - 1) - log r) of KL(old || new)), ``ratio_mean``; metrics are
    detached 0-d tensors, all token-means.
    Raises ValueError on shape mismatch, negative clip ratios, ``dual_clip <= 1`` or an unknown
    reduction.
    """
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, loss_mask=loss_mask
    )
    pg, terms = _clipped_surrogate(logprobs, old_logprobs, advantages, loss_mask, clip_ratio_low,
                                   clip_ratio_high, dual_clip)
    return {"loss": aggregate_loss(pg, loss_mask, reduction=reduction), **terms}


def _clipped_surrogate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-element clipped surrogate ``pg`` of ratio = exp(logprobs - ref_logprobs) (shapes checked by the
    caller) and its detached metrics (clipfrac, dual_clipfrac, approx_kl, ratio_mean)."""
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(
            f"clip_ratio_low/high must be >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (or None), got {dual_clip}")
    keep = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    ref_logprobs, advantages = ref_logprobs.detach(), advantages.detach()
    # constants at masked slots -> 0, so NaN there cannot reach the gradient (-A * dratio = NaN * 0 = NaN)
    advantages = torch.where(keep, advantages, torch.zeros_like(advantages))

    # Zero the log-ratio at masked slots before exp so garbage there cannot produce inf*0 = NaN grads.
    log_ratio = torch.where(keep, logprobs - ref_logprobs, torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    surr_unclipped = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(surr_unclipped, surr_clipped)
    if dual_clip is not None:
        surr_dual = -advantages * dual_clip
        dual_active = (advantages < 0) & (pg > surr_dual)
        pg = torch.where(advantages < 0, torch.minimum(pg, surr_dual), pg)
    else:
        dual_active = torch.zeros_like(keep)

    with torch.no_grad():
        clipfrac = masked_mean((surr_clipped > surr_unclipped).to(pg.dtype), loss_mask)
        dual_clipfrac = masked_mean(dual_active.to(pg.dtype), loss_mask)
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, loss_mask)
        ratio_mean = masked_mean(ratio, loss_mask)
    return pg, {
        "clipfrac": clipfrac.detach(),
        "dual_clipfrac": dual_clipfrac.detach(),
        "approx_kl": approx_kl.detach(),
        "ratio_mean": ratio_mean.detach(),
    }


def decoupled_ppo_actor_loss(
    *,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None = None,
    behaviour_weight_cap: float | None = None,
    reduction: str = "token-mean",
) -> dict[str, torch.Tensor]:
    """Decoupled PPO (Hilton et al. 2021, "Batch size-invariance for policy optimization", the objective of
    asynchronous RL trainers such as AReaL): samples drawn by a stale *behaviour* policy, trust region around
    the *proximal* policy (the weights at the start of this update)::

        ratio = exp(logprobs - proximal_logprobs)                  (clipped exactly as in ``ppo_actor_loss``)
        w     = exp(proximal_logprobs - behaviour_logprobs)        (log clamped to [-20, 20])
        pg    = w * max(-A * ratio, -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high))
        loss  = reduction(pg, loss_mask)

    With ``behaviour_weight_cap`` set, elements with w > cap get weight 0 (they stay in the denominator of the
    reduction; AReaL's ``behav_imp_weight_cap``). With proximal == behaviour, w = 1 and the loss equals
    ``ppo_actor_loss(old_logprobs=behaviour_logprobs)`` exactly.

    All tensors share one shape (no broadcasting); proximal/behaviour log-probs and advantages are constants.
    Returns the terms of ``ppo_actor_loss`` (ratio metrics taken against the proximal policy) plus
    ``behaviour_weight_mean`` (masked mean of w after the cap) and ``behaviour_capfrac`` (fraction capped).
    Raises ValueError as ``ppo_actor_loss`` does, and on ``behaviour_weight_cap <= 1``.
    """
    _check_same_shape(logprobs=logprobs, proximal_logprobs=proximal_logprobs,
                      behaviour_logprobs=behaviour_logprobs, advantages=advantages, loss_mask=loss_mask)
    if behaviour_weight_cap is not None and behaviour_weight_cap <= 1.0:
        raise ValueError(f"behaviour_weight_cap must be > 1.0 (or None), got {behaviour_weight_cap}")
    pg, terms = _clipped_surrogate(logprobs, proximal_logprobs, advantages, loss_mask, clip_ratio_low,
                                   clip_ratio_high, dual_clip)
    keep = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    with torch.no_grad():
        log_w = torch.where(keep, proximal_logprobs - behaviour_logprobs, torch.zeros_like(pg))
        w = torch.exp(log_w.clamp(-20.0, 20.0))
        capped = (w > behaviour_weight_cap) & keep if behaviour_weight_cap is not None else torch.zeros_like(keep)
        w = torch.where(capped, torch.zeros_like(w), w)
    loss = aggregate_loss(pg * w, loss_mask, reduction=reduction)
    with torch.no_grad():
        terms["behaviour_weight_mean"] = masked_mean(w, loss_mask)
        terms["behaviour_capfrac"] = masked_mean(capped.to(pg.dtype), loss_mask)
    return {"loss": loss, **terms}


def _explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var[target - pred] / Var[target] over masked elements; 0 when Var[target] == 0."""
    mean_t = masked_mean(target, mask)
    var_t = masked_mean((target - mean_t) ** 2, mask)
    resid = target - pred
    var_r = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
    safe = torch.where(var_t > 0, var_t, torch.ones_like(var_t))
    return torch.where(var_t > 0, 1.0 - var_r / safe, torch.zeros_like(var_t))


def critic_loss(
    *,
    values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    value_clip: float | None,
    old_values: torch.Tensor | None = None,
    reduction: str = "token-mean",
) -> dict[str, torch.Tensor]:
    """Value loss with optional PPO2 value clipping (as in OpenAI baselines ppo2 / verl
    ``compute_value_loss``). All tensors share one shape, e.g. [N] or [N, C]::

        unclipped = (v - R)^2
        clipped   = (old + clamp(v - old, -c, c) - R)^2          (c = value_clip)
        loss      = reduction(0.5 * max(unclipped, clipped), loss_mask)   if value_clip is set
                  = reduction(0.5 * unclipped, loss_mask)                 otherwise

    ``old_values`` and ``returns`` are constants (detached); ``old_values`` is required when
    ``value_clip`` is set.

    Returns dict: ``loss`` (differentiable scalar), ``clipfrac`` (fraction where the clipped term is
    larger; 0 without clipping), ``explained_variance`` (1 - Var[R - v] / Var[R], masked, population
    variances; 0 when Var[R] == 0); metrics detached 0-d tensors.
    Raises ValueError on shape mismatch, ``value_clip <= 0`` or a missing ``old_values``.
    """
    returns = returns.detach()
    if value_clip is not None:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 (or None to disable), got {value_clip}")
        if old_values is None:
            raise ValueError("old_values is required when value_clip is set")
        _check_same_shape(values=values, old_values=old_values, returns=returns, loss_mask=loss_mask)
    else:
        _check_same_shape(values=values, returns=returns, loss_mask=loss_mask)
    keep = loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0
    # constants at masked slots -> 0, so NaN there cannot reach the gradient of v (2 (v - NaN) * 0 = NaN)
    returns = torch.where(keep, returns, torch.zeros_like(returns))
    if value_clip is None:
        per_elem = 0.5 * (values - returns) ** 2
        clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        old_values = torch.where(keep, old_values.detach(), torch.zeros_like(old_values))
        unclipped = (values - returns) ** 2
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (v_clipped - returns) ** 2
        per_elem = 0.5 * torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clipfrac = masked_mean((clipped > unclipped).to(values.dtype), loss_mask)
    loss = aggregate_loss(per_elem, loss_mask, reduction=reduction)
    with torch.no_grad():
        ev = _explained_variance(values, returns, loss_mask)
    return {"loss": loss, "clipfrac": clipfrac.detach(), "explained_variance": ev.detach()}


def entropy_bonus(
    entropy: torch.Tensor, loss_mask: torch.Tensor, *, reduction: str = "token-mean"
) -> torch.Tensor:
    """Masked mean entropy (a positive number; the caller subtracts ``entropy_coef * bonus`` from the
    loss). ``entropy`` and ``loss_mask`` share one shape (ValueError otherwise). Differentiable."""
    return aggregate_loss(entropy, loss_mask, reduction=reduction)


def normalize_advantages(
    adv: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-8
) -> torch.Tensor:
    """(adv - mean) / (std + eps) with mean and std taken over masked elements only.

    std is the population std (``unbiased=False``: divides by the mask sum, not sum - 1). ``mask`` is
    bool or float of the same shape as ``adv`` (ValueError otherwise). Returns the same shape; masked-out
    positions are set to 0 (whatever they held, NaN included).

    Degenerate statistics give defined, finite values (never a NaN or a rounding residue blown up by 1/eps):

    * empty mask: all zeros;
    * the masked values are a tie (one element included; ``tasks.algorithms.ties.is_tie``: equal up to rounding
      relative to their magnitude, spread <= 64 * eps(dtype) * max|adv|): all zeros (no spread: A - mean is 0 by
      definition, and dividing rounding noise by its own std would turn it into +-1);
    * otherwise 0 < std < eps (absolute): centred only, ``adv - mean`` (dividing by ~eps would blow a tiny spread
      up to +-1);
    * otherwise the formula above (unchanged, bit for bit).

    Raises:
        ValueError: shape mismatch, or a NaN/inf inside the mask (it would poison the mean and std of every
            sample): names how many and the first index; drop such samples from the mask first
            (``algorithm.nonfinite=mask`` does that in ``tasks.actor.entries.advantages``).
    """
    _check_same_shape(adv=adv, mask=mask)
    keep = mask if mask.dtype == torch.bool else mask != 0
    bad = keep & ~torch.isfinite(adv)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"advantages: {int(bad.sum())} non-finite value(s) inside the mask, first at index {first} "
                         f"({float(adv[first])}); drop them from the mask before normalising")
    mean = masked_mean(adv, mask)
    var = masked_mean((adv - mean) ** 2, mask)
    std = var.sqrt()
    out = (adv - mean) / (std + eps)
    out = torch.where(std < eps, adv - mean, out)
    out = torch.where(is_tie(adv, member=keep), torch.zeros_like(out), out)  # a tie (or a single element)
    return torch.where(keep, out, torch.zeros_like(out))
