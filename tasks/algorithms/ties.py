"""When is a spread of scores a tie? The one rule every std normalisation uses (GRPO's group std, RLOO's group
baseline, the update's batch normalisation of advantages).

Dividing by a standard deviation turns any spread into unit size, so a spread that is only floating-point rounding
noise (scores of one value reached by different summation orders, a reward scaled twice, 1 ulp apart) would come out
as full-size advantages of random sign: GRPO on float32 ``[25, 25, 25, nextafter(25)]`` gave ``[0, 0, 0, 0.908]``
and ``[1000, 1000 + 1 ulp, 1000, 1000]`` gave 1.684 for the odd one out (issue 47). Values are a TIE when their spread is within rounding of their magnitude::

    max(x) - min(x) <= TIE_ULPS * eps(dtype) * max|x|        (eps = torch.finfo(dtype).eps: 1.19e-7 float32,
                                                              2.22e-16 float64, 9.8e-3 bfloat16)

``TIE_ULPS = 64``. Source of the bound: a score is a sum of up to T chunk rewards; the rounding error of a
floating-point sum of n terms is at most (n - 1) * u * sum|r_i| (u = eps / 2; Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., eq. 4.4), so two sums of the same rewards taken along different paths differ by up
to ~ n * eps * max|score| when the rewards share a sign. 64 covers such sums over 64 terms (more than the chunk steps
of an episode in the shipped configs) and the few extra roundings of a reward scale and of the mean; it is
still 8000x below a genuine 1e-3 relative difference in float32 (1e-3 / 1.19e-7 = 8400 ulps), which is not a tie.
For float32 the relative tolerance is 7.6e-6, for float64 1.4e-14.

Non-finite values never make a tie (their spread is NaN or inf); callers reject or mask them before.
"""

from __future__ import annotations

import torch

__all__ = ["TIE_ULPS", "tie_tolerance", "is_tie"]

TIE_ULPS = 64  # the k of `spread <= k * eps(dtype) * max|x|` (module docstring: why 64)


def tie_tolerance(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The largest spread that is still a tie for values of size ``magnitude`` (any shape, >= 0) in ``dtype``
    (a floating dtype): ``TIE_ULPS * finfo(dtype).eps * magnitude``, same shape as ``magnitude``.

    Raises:
        TypeError: ``dtype`` is not a floating-point dtype (torch.finfo's own error)."""
    return magnitude * (TIE_ULPS * torch.finfo(dtype).eps)


def is_tie(x: torch.Tensor, *, member: torch.Tensor | None = None, dim: int | None = None) -> torch.Tensor:
    """Whether the values of ``x`` (over ``dim``, or all of it when None) are a tie: ``max - min <=
    tie_tolerance(max|x|, x.dtype)`` over the entries where ``member`` is True (module docstring).

    Args:
        x: floating tensor, any shape (e.g. group scores [G, g] with ``dim=-1``, advantages [N, C] with
            ``dim=None``).
        member: bool tensor of ``x``'s shape, or None (all): entries taking part. Others are never read (NaN there
            is fine).
        dim: the dim to reduce, or None for all.
    Returns:
        bool tensor, ``x``'s shape without ``dim`` (0-d when ``dim`` is None). True where no entry or one entry
        takes part (nothing to spread), or all members are exactly equal (0 included); False where a member is
        NaN/inf (with two or more members).
    Raises:
        ValueError: ``x`` is not floating point, or ``member`` has another shape or is not bool.
    """
    if not x.is_floating_point():
        raise ValueError(f"is_tie needs a floating-point tensor, got dtype {x.dtype}")
    if member is None:
        member = torch.ones_like(x, dtype=torch.bool)
    if member.dtype != torch.bool or member.shape != x.shape:
        raise ValueError(f"member must be a bool tensor of shape {tuple(x.shape)}, got {member.dtype} "
                         f"{tuple(member.shape)}")
    if dim is None:  # all of it: one flat dim ([...] -> [N]); an empty tensor is a tie (nothing to spread)
        if x.numel() == 0:
            return torch.ones((), dtype=torch.bool, device=x.device)
        x, member, dim = x.reshape(-1), member.reshape(-1), 0
    hi = torch.where(member, x, torch.full_like(x, -torch.inf)).amax(dim)
    lo = torch.where(member, x, torch.full_like(x, torch.inf)).amin(dim)
    size = torch.where(member, x.abs(), torch.zeros_like(x)).amax(dim)  # max|x| over the members
    one = member.sum(dim) < 2  # no spread to speak of (the inf - inf of an empty set would be NaN, not a tie)
    spread = torch.where(one, torch.zeros_like(hi), hi - lo)
    finite = torch.where(member, torch.isfinite(x), torch.ones_like(member)).all(dim)  # [5, inf, 5] is no tie
    return one | (finite & (spread <= tie_tolerance(size, x.dtype)))
