"""The actor update as a distributed task group: `actor_update[r]` for actor ranks r = 0..R-1 form one
torch.distributed process group (gloo on CPU, nccl on CUDA) that lives across training steps in the GPU workers,
with the policy sharded by FSDP2 (`torch.distributed.fsdp.fully_shard`).

Batch sizes (RLinf's `actor.global_batch_size` / `actor.micro_batch_size`, its FSDP actor worker's
`run_training`; `tasks.config.check_batch_sizes` is the offline check):
  batch_size B        samples per training step (chunk steps: rollout.chunk_steps * env.num_envs)
  global_batch_size G samples per optimizer step over all ranks (default B / algorithm.num_minibatches, which makes
                      one rank the single-process `tasks.actor.entries.actor_update`)
  micro_batch_size M  samples per forward/backward on one rank (default G / R: no accumulation)
  one update epoch = B / G optimizer steps; each rank takes G / R samples of each step's minibatch and runs
  grad_accum = G / (M * R) micro-batches, the last one synchronising gradients (FSDP reduce-scatter).
  Divisibility: B % G == 0 and G % (M * R) == 0, else ConfigError.

Loss weighting: every loss term of the single-process update is a token-mean over a mask of the minibatch
(tasks.algorithms.losses). A micro-batch's term is weighted by its share of the minibatch's mask count
(counted over all ranks: every rank holds the whole batch), so the summed gradient is exactly the gradient of the
minibatch's token-mean, whatever the split. With full masks and equal micro-batches the weight is 1/(grad_accum*R),
RLinf's `loss / gradient_accumulation` with averaged ranks. The loss is multiplied by R because FSDP averages
gradients over ranks. Metrics are the same share-weighted sums, all-reduced once per optimizer step: actor_loss,
critic_loss, entropy, approx_kl, clipfrac, ratio_mean and loss equal the single-process values;
explained_variance (not a mean) is the share-weighted mean of the micro-batches' values. `target_kl` is decided
on the all-reduced approx_kl, so all ranks stop together (a rank stopping alone would hang the others).

One loop: the epochs, minibatches, critic warm-up, the skip of a step with a non-finite loss (a count all-reduced
with the metrics) or gradient norm (the global norm), target_kl and the metrics are `tasks.actor.loop.run_update`,
the function the one-rank update calls as a world of one; this module only adds the process group, FSDP2 and
`torch.distributed.all_reduce`. Every rank therefore skips the same steps, and none steps alone.

Minibatches: every rank receives all samples (the graph passes every advantages_s* output to every rank), draws
the same permutation per epoch from `torch.Generator().manual_seed(permutation_seed(cfg, version))` (the one-rank
update draws the same ones: tasks.actor.loop's randomness rule), and takes the contiguous slice [r * G/R, (r+1) * G/R) of each minibatch, then micro-batches in order: a deterministic split.
Advantage normalisation is over the whole batch on every rank (identical; no communication).

How the graph uses it (pipelines.graphs, pipelines.runner with `algorithm.num_actor_ranks` > 1):
  - One node per rank, `actor_update_r{r}-<run>-<step>`, calling
    `actor_update_rank(cfg, run_id, specs[r], weights, *advs)` with `specs = group_specs(...)`, pinned to that
    rank's GPU worker (`workers=[gpu_worker[r]], allow_other_workers=False, resources={"GPU": 1}`), ranks on
    DISTINCT workers (two ranks in one worker process would deadlock), all in the same step graph so Dask runs
    them together (each blocks in the first collective until all ranks arrive).
  - Rank 0's output {"version", "state_dict", "metrics"} is the new weights (the future the next step's rollout
    takes); ranks > 0 return {"version", "metrics", "rank"}. With frozen parameters (LoRA, `policy.freeze`) and the
    group spec's `base_key` (the Dask key of the init's full weights, which the runner keeps for the generation),
    they are partial weights (tasks.weights.partial): `sync_weights_rank` gathers only the trainable tensors from
    the FSDP shards, so neither the gather nor the sync moves the frozen ones. Keep every rank's future (e.g. as a
    dependency of step_metrics) so a failed rank fails the step.
  - `master_addr` is rank 0's worker host, `master_port` a free port there (`free_port` run on that worker with
    `client.submit(free_port, workers=[w0], pure=False)`), `generation` 0 at start.
  - Checkpoint: `actor_state_rank(run_id, cfg, group, weights, dims)` on every rank (a collective; one node per rank
    as above); rank 0 returns THE actor state (tasks.actor.state: policy, FQN-keyed optimizer, rng, weight_version:
    the one-rank actor's format too, so a checkpoint moves between 1 and R ranks).
    Restore: `initial_weights(cfg, dims, checkpoint)` gives weights={"version", "state_dict", "optimizer"} for a
    new generation; the group is rebuilt from them.

A lost rank: the surviving ranks block in a collective until the group's timeout (`timeout_s`, default
DEFAULT_TIMEOUT_S) and then raise. The runner cancels the step's futures, restarts the surviving actor workers
(a thread blocked in a collective cannot be interrupted; `client.restart_workers` frees them at once) or waits
for the timeout, re-plans placement, rolls back to the last checkpoint as for the single-process actor, and
resubmits the step with `generation + 1` and a new `master_port` (a new rank 0 address if rank 0 was lost).
`actor_update_rank` sees the new generation, destroys its old group (if any survives on that worker), joins the
new one and rebuilds the sharded policy and optimizer from `weights` (fresh optimizer unless `weights` carries
"optimizer"), reporting `train/group_built` = 1 and `train/actor_rebuilt` = 1. A node with a generation older
than the worker's group raises (a stale retry must not join a dead group); the same generation with another
rank/world/address raises too (bump the generation to change the group).

Sources: RLinf `rlinf/workers/actor/fsdp_actor_worker.py` (`run_training`: global/micro batch, gradient
accumulation, divisibility asserts, metrics all-reduced with AVG); PyTorch FSDP2 (`fully_shard`,
`register_fsdp_forward_method`, `set_requires_gradient_sync`) and `torch.distributed.checkpoint.state_dict`.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from tasks import resident, seeding
from tasks.actor.loop import behaviour_version, flatten, run_update
from tasks.actor.nonfinite import nonfinite_metrics
from tasks.actor.optim import make_optimizer
from tasks.actor.state import actor_state_dict, load_model_state, load_optimizer_state, model_state
from tasks.config import Config

DEFAULT_TIMEOUT_S = 300.0  # process-group timeout: how long a rank waits in a collective for a lost peer
_INITS = 0  # process groups this process has initialised (tests count them)


# ---------------------------------------------------------------- batch sizes (offline check)
# the batch plan: a pure offline check, defined in tasks.config (which imports nothing else of tasks)
from tasks.config import batch_plan  # noqa: E402


# ---------------------------------------------------------------- the process group
def free_port(host: str = "") -> int:
    """A TCP port free on this host now (run it on rank 0's worker to choose `master_port`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def group_specs(world_size: int, master_addr: str, master_port: int, generation: int,
                timeout_s: float | None = None, base_key=None) -> list[dict]:
    """The `group` argument of each rank's node: [{rank, world_size, master_addr, master_port, generation,
    timeout_s, base_key}] for ranks 0..world_size-1. `base_key`: the Dask key (tasks.weights.KeyName, so the graph
    does not substitute it, or str) of the generation's initial full weights, the base of the partial weights rank 0
    hands out with frozen parameters (`sync_weights_rank`); None: full weights."""
    return [{"rank": r, "world_size": world_size, "master_addr": master_addr, "master_port": int(master_port),
             "generation": int(generation), "timeout_s": DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s,
             "base_key": base_key} for r in range(world_size)]


def group_inits() -> int:
    """How many process groups this process has initialised (one per generation in a healthy run)."""
    return _INITS


@dataclass
class RankState:
    """One rank's resident state: its process group membership, sharded policy and optimizer, weight version."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    generation: int
    device: torch.device
    policy: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    version: int = 0

    def same_group(self, group: dict) -> bool:
        return (self.rank, self.world_size, self.master_addr, self.master_port) == (
            int(group["rank"]), int(group["world_size"]), str(group["master_addr"]), int(group["master_port"]))

    def close(self) -> None:
        """Destroy the process group (resident.release calls this)."""
        import torch.distributed as dist
        self.policy = self.optimizer = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _key(run_id: str) -> str:
    return f"{run_id}/actor_group"


def _join(cfg: Config, run_id: str, group: dict, weights: dict, dims: tuple[int, int]) -> tuple[RankState, bool]:
    """The resident rank state for `group`, (re)building the process group and sharded policy when needed.

    Raises:
        RuntimeError: `group["generation"]` is older than this worker's group (a stale node).
        ValueError: same generation but another rank/world/address/port (bump the generation to change a group).
    """
    import torch.distributed as dist
    gen = int(group["generation"])
    st: RankState | None = resident.get(_key(run_id))
    if st is not None:
        if gen < st.generation:
            raise RuntimeError(f"actor_update rank {group['rank']}: generation {gen} is older than this worker's "
                               f"process group (generation {st.generation}); a stale node must not join")
        if gen == st.generation:
            if not st.same_group(group):
                raise ValueError(f"actor_update: group {group} differs from generation {gen}'s group "
                                 f"(rank {st.rank}/{st.world_size} at {st.master_addr}:{st.master_port}); "
                                 f"bump the generation to change it")
            return st, False
        resident.release(_key(run_id))  # closes the old group
    elif dist.is_initialized():  # a group left by another run: this module owns the worker's default group
        dist.destroy_process_group()
    return _build(cfg, run_id, group, weights, dims), True


def _build(cfg: Config, run_id: str, group: dict, weights: dict, dims: tuple[int, int]) -> RankState:
    """Join the process group, build the policy from `weights["state_dict"]`, shard it (FSDP2), make the
    optimizer (loading `weights["optimizer"]` when given: the FQN-keyed full state of `actor_state_rank`)."""
    global _INITS
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from tasks.policies import make_policy
    from tasks.rollout import image_size, num_values
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, world = int(group["rank"]), int(group["world_size"])
    addr, port = str(group["master_addr"]), int(group["master_port"])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=float(group.get("timeout_s")
                                                                                or DEFAULT_TIMEOUT_S)))
    _INITS += 1
    mesh = init_device_mesh(device.type, (world,))
    policy = make_policy(cfg.policy, obs_dim=dims[0], action_dim=dims[1], num_values=num_values(cfg),
                         seed=seeding.model_init_seed(cfg.seed), image_size=image_size(cfg), load=False)
    load_model_state(policy, weights["state_dict"])
    policy.to(device)
    units = getattr(policy, "fsdp_units", None)  # optional hook: submodules to shard as their own units (VLA blocks)
    for module in (units() if callable(units) else []):
        fully_shard(module, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    register_fsdp_forward_method(policy, "evaluate")  # FSDP2 unshards around forward(); the update calls evaluate()
    opt = make_optimizer(cfg, policy)  # over the sharded (DTensor) parameters
    if weights.get("optimizer") is not None:  # THE format: a checkpoint of 1 rank loads on R ranks
        load_optimizer_state(policy, opt, weights["optimizer"])
    st = RankState(rank, world, addr, port, int(group["generation"]), device, policy, opt,
                   int(weights["version"]))
    resident.put(_key(run_id), st)
    return st


def release_group(run_id: str) -> int:
    """Destroy this worker's process group of `run_id` and drop its sharded actor (e.g. `client.run` at shutdown)."""
    return resident.release(_key(run_id))


# ---------------------------------------------------------------- the rank function
def _all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist
    dist.all_reduce(x)  # SUM
    return x


def actor_update_rank(cfg: Config, run_id: str, group: dict, weights: dict, *samples: dict) -> dict:
    """One rank's share of the PPO update (see the module docstring); a collective: every rank must call it.

    Args:
        group: {rank, world_size, master_addr, master_port, generation[, timeout_s]} (`group_specs`).
        weights: {"version": int, "state_dict": full CPU state dict[, "optimizer": FQN-keyed full optimizer state]};
            the state dicts are only read when the group is (re)built.
        samples: every shard's advantages output (tasks.actor.entries.advantages): fields [T, B_s, ...] as numpy arrays.

    Returns:
        rank 0: {"version": v+1, "state_dict": full CPU state dict (float32 clones), "metrics": {...}}, or with
        frozen parameters and `group["base_key"]` partial weights (`sync_weights_rank`: "state_dict" the trainable
        tensors, "partial": True, "base_key");
        other ranks: {"version": v+1, "rank": r, "metrics": {...}}. Metrics (train/*) are identical on all ranks
        except time/update (this rank's wall time).

    Raises:
        ConfigError: batch sizes that do not divide (check_batch_sizes).
        RuntimeError / ValueError: a stale or inconsistent `group` (_join); torch.distributed errors after
            `timeout_s` when a peer is lost.
    """
    t0 = time.perf_counter()
    data = flatten(samples)
    N, D = data["actions"].shape[0], data["actions"].shape[-1]
    st, built = _join(cfg, run_id, group, weights, (data["obs"].shape[-1], D))
    rank, world = st.rank, st.world_size
    plan = batch_plan(cfg, batch_size=N, num_ranks=world)  # a ConfigError here is raised on every rank alike
    data = {k: v.to(st.device) for k, v in data.items()}  # [N, ...] on this rank's device
    metrics = run_update(cfg, st.policy, st.optimizer, data, version=int(weights["version"]),
                         behaviour=behaviour_version(weights, samples), plan=plan, rank=rank, world=world, all_reduce=_all_reduce_sum)
    st.version = int(weights["version"]) + 1
    synced = sync_weights_rank(st.policy, st.version, group.get("base_key"))  # a collective: every rank
    metrics.update({"train/actor_rebuilt": float(built and st.generation > 0), **nonfinite_metrics(samples),
                    "train/group_built": float(built), "train/group_generation": float(st.generation),
                    "train/actor_ranks": float(world), "train/grad_accum": float(plan.grad_accum),
                    "train/weight_version": float(st.version), "time/update": time.perf_counter() - t0})
    out = {"version": st.version, "metrics": metrics}
    if rank == 0:
        out.update(synced)
    else:
        out["rank"] = rank
    return out


def sync_weights_rank(policy: torch.nn.Module, version: int, base_key=None) -> dict:
    """What rank 0 hands the rollout replicas after an update of the (FSDP2-sharded) `policy`; a collective: every
    rank calls it, rank 0 gets the weights, the other ranks {} (torch.distributed.checkpoint gathers full tensors
    to rank 0 only).

    Partial weights (tasks.weights.partial: {"version", "state_dict": the trainable tensors, "partial": True,
    "base_key"}) when the policy ships only part of its state (its `sync_state` capability) and has frozen
    parameters, and `base_key` (the Dask key of the generation's initial full weights; tasks.weights.KeyName or
    str) is given: only the parameters with requires_grad are gathered from the shards
    (`get_model_state_dict(ignore_frozen_params=True)`; frozen ones never leave their shards), then the policy's
    `sync_state(state_dict)` picks its entries. Else full weights {"version", "state_dict": `model_state`}.
    Whether it is partial depends on requires_grad flags and `base_key` alone, identical on every rank, so the
    ranks always enter the same collective."""
    sync = getattr(policy, "sync_state", None)
    key = getattr(base_key, "key", base_key)
    if sync is None or key is None or all(p.requires_grad for p in policy.parameters()):
        return {"version": version, "state_dict": model_state(policy)}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                               ignore_frozen_params=True))
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_rank() != 0:  # gathered to rank 0 only
        return {}
    from tasks.weights import partial
    part = sync({k: v.detach().to("cpu", copy=True) for k, v in sd.items()})
    return partial(version, part, key)


def actor_state_rank(run_id: str, cfg: Config | None = None, group: dict | None = None,
                     weights: dict | None = None, dims: tuple[int, int] | None = None) -> dict:
    """Full policy and optimizer state of the sharded actor, for a checkpoint (a collective: call on every rank).

    With `cfg, group, weights, dims` given, the group is first joined as `actor_update_rank` would (built from
    `weights` when this worker has none of that generation: a checkpoint right after a restore, before any update).

    Returns on rank 0 THE actor state (tasks.actor.state.actor_state_dict: "policy", "optimizer" (FQN-keyed, the
    format `weights["optimizer"]` takes), "rng" (this process's RNG streams), "weight_version"), the one-rank
    actor's format; {} on other ranks.
    Raises RuntimeError when this worker holds no actor group for `run_id` (and none is given to build).
    """
    if group is not None:
        if cfg is None or weights is None or dims is None:
            raise ValueError("actor_state_rank: joining a group needs cfg, weights and dims")
        _join(cfg, run_id, group, weights, tuple(dims))
    st: RankState | None = resident.get(_key(run_id))
    if st is None or st.policy is None:
        raise RuntimeError(f"no distributed actor for run {run_id} on this worker")
    return actor_state_dict(st.policy, st.optimizer, st.version, rank=st.rank)  # a collective: every rank


def initial_weights(cfg: Config, dims: tuple[int, int], checkpoint: dict | None = None) -> dict:
    """The weights the ranks build their group from (the init graph's node on rank 0's worker; no resident state).

    Fresh: the policy `tasks.actor.entries.actor_init` would make (seeded by `cfg.seed`, `policy.model_path` loaded);
    from a checkpoint written by the ranks (`actor_state_rank`): its policy, optimizer and weight version.

    Returns {"version": int, "state_dict": full CPU state dict[, "optimizer": FQN-keyed full optimizer state]}.
    """
    from tasks.policies import make_policy
    from tasks.rollout import image_size, num_values
    if checkpoint is not None:
        opt = checkpoint["optimizer"]
        return {"version": int(checkpoint["run"]["weight_version"]), "state_dict": checkpoint["policy"],
                "optimizer": opt}
    torch.manual_seed(seeding.model_init_seed(cfg.seed))
    policy = make_policy(cfg.policy, obs_dim=dims[0], action_dim=dims[1], num_values=num_values(cfg),
                         seed=seeding.model_init_seed(cfg.seed), image_size=image_size(cfg), load=True)
    from tasks.demo_index import set_demo_stats
    set_demo_stats(cfg, policy)  # as tasks.actor.entries.actor_init
    return {"version": 0, "state_dict": {k: v.detach().clone() for k, v in policy.state_dict().items()}}
