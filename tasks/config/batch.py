"""Batch sizes of the actor update (offline checks; tasks.distributed re-exports them): RLinf's divisibility rules."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.config.errors import ConfigError

if TYPE_CHECKING:
    from tasks.config.schema import Config


@dataclass(frozen=True)
class BatchPlan:
    """Resolved batch sizes of one distributed update (all in samples = chunk steps)."""

    batch_size: int  # B: samples per training step
    num_ranks: int  # R
    global_batch_size: int  # G: samples per optimizer step over all ranks
    micro_batch_size: int  # M: samples per forward/backward on one rank

    @property
    def per_rank_batch_size(self) -> int:
        return self.global_batch_size // self.num_ranks

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.per_rank_batch_size // self.micro_batch_size

    @property
    def num_minibatches(self) -> int:
        """Optimizer steps per update epoch."""
        return self.batch_size // self.global_batch_size


def check_batch_sizes(batch_size: int, num_ranks: int, global_batch_size: int, micro_batch_size: int) -> BatchPlan:
    """Check RLinf's divisibility rules and return the plan.

    Rules: all >= 1; `batch_size % global_batch_size == 0` (whole optimizer steps per epoch);
    `global_batch_size % (micro_batch_size * num_ranks) == 0` (each rank runs whole micro-batches).

    Raises:
        ConfigError: naming the key (algorithm.global_batch_size / micro_batch_size / num_actor_ranks), the value and
            the numbers that do not divide.
    """
    for key, val in (("batch_size", batch_size), ("algorithm.num_actor_ranks", num_ranks),
                     ("algorithm.global_batch_size", global_batch_size),
                     ("algorithm.micro_batch_size", micro_batch_size)):
        if int(val) != val or val < 1:
            raise ConfigError(key, val, "must be an integer >= 1")
    if batch_size % global_batch_size:
        step = micro_batch_size * num_ranks
        divisors = [d for d in range(step, batch_size + 1, step) if batch_size % d == 0]
        hint = f"; e.g. {min(divisors, key=lambda d: abs(d - global_batch_size))}" if divisors else ""
        raise ConfigError("algorithm.global_batch_size", global_batch_size,
                          f"must divide the batch of {batch_size} samples (rollout.chunk_steps*env.num_envs): "
                          f"an update epoch is batch/global optimizer steps{hint}")
    if global_batch_size % (micro_batch_size * num_ranks):
        raise ConfigError("algorithm.micro_batch_size", micro_batch_size,
                          f"micro_batch_size*num_actor_ranks = {micro_batch_size}*{num_ranks} = "
                          f"{micro_batch_size * num_ranks} must divide algorithm.global_batch_size="
                          f"{global_batch_size} (each rank runs global/(micro*ranks) micro-batches per step)")
    return BatchPlan(batch_size, num_ranks, global_batch_size, micro_batch_size)


def batch_plan(cfg: Config, batch_size: int | None = None, num_ranks: int | None = None) -> BatchPlan:
    """The plan for `cfg` (defaults: batch_size = cfg.batch_size, num_ranks = algorithm.num_actor_ranks,
    global = batch / algorithm.num_minibatches, micro = global / ranks). Raises ConfigError (check_batch_sizes)."""
    a = cfg.algorithm
    B = cfg.batch_size if batch_size is None else batch_size
    R = a.num_actor_ranks if num_ranks is None else num_ranks
    G = a.global_batch_size if a.global_batch_size is not None else max(B // a.num_minibatches, 1)
    M = a.micro_batch_size if a.micro_batch_size is not None else max(G // max(R, 1), 1)
    return check_batch_sizes(B, R, G, M)
