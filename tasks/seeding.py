"""Every seed rule of dagrl, in one place: the functions below are the ONLY places a seed is computed.

Call sites pass plain ints (`cfg.seed`, `env.seed`, `env.eval.seed`, weight versions, shard indices), so every rule
is a pure function, tested against its formula in tests/tasks/test_seeding.py. Changing a formula changes every
run's numbers (and resumes of old checkpoints stop being exact): do it only with a note.

Notation: g = global env index (0 <= g < N, N = env.num_envs, shard s of S holds g = s*N/S ... (s+1)*N/S - 1),
k = episode count of env g (episodes it started before), G = envs per GRPO group (`algorithm.group_size` with GRPO,
else 1), v = weight version of the update, r = actor rank, p = shard part (shard index; with pipeline stages
`shard * pipeline_stage_num + stage`).

| rule | function | formula | where used | why |
|---|---|---|---|---|
| train episode reset seed | `episode_seed` | `base_seed + g // G + k * (N // G)` (`base_seed` = `env.seed`) | EnvShard's default `seed_fn` (tasks/envs/shard.py, batched.py): training, record and eval shards; the store's `seed_rule` attr (`TRAIN_SEED_RULE`) | every (env, episode) pair its own replayable seed; the G members of a GRPO group share every seed (same initial state) |
| GRPO groups | `episode_seed` with G = group_size | envs g = jG .. jG+G-1 get `base_seed + j + k * (N // G)` | as above (`tasks.rollout.group_size`) | a group's members start from the same state, so their return differences score the actions |
| episode id | `episode_id` | `g + k * N` | EnvShard (episode dicts, `episode_id` field), replay's index | unique per (env, episode); with G = 1 `episode_seed = base_seed + episode_id` (replay checks it) |
| eval episode seed | `eval_episode_seed` | `eval.seed + i` for eval episode i (env i % N_eval, k = i // N_eval: `episode_seed` with G = 1, N = `eval.num_envs`) | tasks.rollout.evaluate (through the eval shard's `episode_seed`), benchmarks/rl_signal.py | the same episodes at every evaluation, distinct from the training seeds when `eval.seed` is |
| eval torch seed | `eval_torch_seed` | `eval.seed + 7919 * shard` | tasks.rollout.evaluate (forked torch RNG around the eval rounds) | a policy drawing in deterministic mode (a flow VLA's initial noise) scores the same at every evaluation, whatever the worker trained before |
| shard policy RNG (colocated exploration noise) | `shard_policy_seed` | `seed * 100003 + p * 7919 + sum(episode counts)` (`seed` = `cfg.seed`) | tasks.rollout.get_shard -> EnvShard.seed_rng (when the cursor carries no RNG state: a fresh shard, a cursor split into another number of stage groups, or one rewritten by `pipelines.upgrade`) | shards on different workers (all starting from torch's default seed) draw different noise; the state earlier versions' global `torch.manual_seed` left, so old runs draw as before |
| disaggregated `policy_infer` draw | `infer_seed` | `SeedSequence([seed mod 2^32] + [x mod 2^32 for each shard's rng_key = (first global env, life chunk steps)]).generate_state(2, uint64)[0] >> 1` | tasks.rollout.policy_infer (forked RNG) | a function of the shards' cursors: a resumed run draws the same noise; the inference worker's own RNG is untouched |
| minibatch permutations | `permutation_seed` | `(seed * 1000003 + v) mod 2^62` | tasks.actor.loop.run_update (`torch.Generator().manual_seed`), 1 and R ranks | the same permutation on every rank; exact resume without saved update state |
| other update draws | `update_seed` | `(seed * 1000033 + v * 8191 + 131071 * (r + 1)) mod 2^62` | tasks.actor.loop.update_rng (PPO/GRPO update), tasks.demos.sft_update (SFT loss draws, r = 0) | draws of a loss (flow VLA noise / time samples) are a function of (seed, v, r): exact resume, the process's rollout streams untouched |
| SFT minibatch sampling | `sft_load_seed` | `seed * 1000003 + step * 101 + loader` | pipelines.graphs.build_sft_step -> tasks.demos.sft_load (`np.random.default_rng`) | reproducible minibatches per (step, loader); loaders draw different rows |
| model init | `model_init_seed` | `seed` | tasks.actor.entries.actor_init / _build_actor, tasks.actor.distributed (rank init), `make_policy(seed=...)` (forked RNG around construction) | the same initial parameters on every rank and every resume-free rerun |
| record | `episode_seed` with G = 1 (`RECORD_SEED_RULE`) | `env.seed + g + k * N`, k = recording round | tasks.demos.record_round (its shard), pipelines.record (store attr) | the recorded episodes are replayable from their seeds; the teacher's own sampling (`record.deterministic=false`) draws from the worker process's torch stream (not seeded: deterministic runs only) |
| benchmark batches (rl_signal) | `rl_signal_batch_seeds` | torch `1000 + i`, env base seed `env.seed + 100000 * (i + 1)` for batch i | benchmarks/rl_signal.py | independent batches of GRPO groups, away from the eval seeds |
| raw-simulator baseline | `raw_env_seed` | `1000 * rank + n` for the n-th reset of worker `rank` (its random actions: `np.random.default_rng(rank)`); the vectorised gym baseline resets env i with `episode_seed(env.seed, i, 0, B)` | benchmarks/throughput.py (gym envs without dagrl) | distinct episodes per process, as the pipeline's |
| LIBERO init state of a reset seed (not a seed: how one is read) | `tasks.envs.libero.reset_states.reset_state_for_seed` | seed >= `eval.seed`: eval split, u = seed - eval.seed, else u = seed - env.seed; task `task_ids[u % T]`, trial `(u // T) % n` of that task's split; `reset_state_id = offset[task] + trial` | LiberoEnv.reset (train, eval and replay shards alike) | the shards' seed rules above pick LIBERO's stored init states: GRPO groups share one, train and eval states disjoint by default |

Fixed constants that are not rules (one micro-benchmark's determinism): `torch.manual_seed(0)` in
benchmarks/policies.py and rl_signal's eval, `Generator().manual_seed(123)` for rl_signal's random direction.

Mechanisms: `seed_devices(seed, devs)` is `torch.manual_seed(seed)` restricted to the CPU generator and the given
CUDA devices (a process's other CUDA devices may hold another component's stream); `forked(seed, devs)` runs a
block on the default generators forked and seeded so, restoring the process's streams after it.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import numpy as np

# the store's `seed_rule` attribute (a description for readers; replay checks `base_seed` with `episode_id`)
TRAIN_SEED_RULE = "episode k of global env g: base_seed + g // group_size + k * (num_envs // group_size)"
RECORD_SEED_RULE = "episode k of global env g: base_seed + g + k * num_envs"

_M62 = 2 ** 62


def episode_seed(base_seed: int, env: int, k: int, num_envs_total: int, group_size: int = 1) -> int:
    """Reset seed of episode `k` of global env `env`: `base_seed + env // group_size + k * (num_envs_total //
    group_size)` (int). GRPO groups (`group_size` consecutive envs) share every seed."""
    return base_seed + env // group_size + k * (num_envs_total // group_size)


def episode_id(env: int, k: int, num_envs_total: int) -> int:
    """Run-unique id of episode `k` of global env `env`: `env + k * num_envs_total` (int)."""
    return int(env + k * num_envs_total)


def eval_episode_seed(eval_seed: int, i: int) -> int:
    """Reset seed of eval episode `i`: `eval_seed + i` (= `episode_seed(eval_seed, i % N, i // N, N)`)."""
    return eval_seed + i


def eval_torch_seed(eval_seed: int, shard: int) -> int:
    """Torch seed of eval shard `shard`'s evaluation: `eval_seed + 7919 * shard`."""
    return eval_seed + 7_919 * shard


def shard_policy_seed(seed: int, part: int, episode_counts: Sequence[int] | None) -> int:
    """Seed of a training shard part's policy RNG: `seed * 100003 + part * 7919 + sum(episode_counts)` (None:
    no counts, 0)."""
    return seed * 100_003 + part * 7_919 + int(sum(episode_counts or []))


def infer_seed(seed: int, keys: Iterable[Sequence[int]]) -> int:
    """Seed of one disaggregated `policy_infer` draw from `seed` and its shards' `EnvShard.rng_key`s (a hash:
    distinct groups and chunk steps give unrelated streams); a non-negative int < 2^63."""
    words = [seed & 0xFFFFFFFF] + [int(x) & 0xFFFFFFFF for k in keys for x in k]
    return int(np.random.SeedSequence(words).generate_state(2, np.uint64)[0] >> np.uint64(1))


def permutation_seed(seed: int, version: int) -> int:
    """Seed of the minibatch permutations of the update on weights `version` (identical on every rank)."""
    return (int(seed) * 1_000_003 + int(version)) % _M62


def update_seed(seed: int, version: int, rank: int = 0) -> int:
    """Seed of the default torch generators inside the update on weights `version` at `rank`."""
    return (int(seed) * 1_000_033 + int(version) * 8_191 + 131_071 * (int(rank) + 1)) % _M62


def sft_load_seed(seed: int, step: int, loader: int) -> int:
    """numpy seed of SFT data loader `loader`'s minibatches at training step `step`."""
    return seed * 1_000_003 + step * 101 + loader


def model_init_seed(seed: int) -> int:
    """Torch seed of a fresh policy's parameters (and of the actor process's RNG at its creation): `seed`."""
    return seed


def rl_signal_batch_seeds(env_seed: int, i: int) -> tuple[int, int]:
    """benchmarks/rl_signal.py batch `i`: (torch seed `1000 + i`, env base seed `env_seed + 100000 * (i + 1)`)."""
    return 1000 + i, env_seed + 100_000 * (i + 1)


def raw_env_seed(rank: int, n: int) -> int:
    """benchmarks/throughput.py raw baseline: seed of the `n`-th reset in worker process `rank`: `1000 * rank + n`."""
    return 1000 * rank + n


# ---------------------------------------------------------------- mechanisms
def seed_devices(seed: int, devs: list) -> None:
    """torch.manual_seed(seed)'s effect on the CPU generator and the CUDA devices `devs` (indices) only (not on
    every CUDA device of the process, which may hold another component's stream)."""
    import torch
    torch.random.default_generator.manual_seed(seed)
    for d in devs:
        with torch.cuda.device(d):
            torch.cuda.manual_seed(seed)


@contextlib.contextmanager
def forked(seed: int, devs: list):
    """Run the block on the CPU generator and CUDA devices `devs` forked (torch.random.fork_rng) and seeded with
    `seed_devices(seed, devs)`; on exit the process's streams are as they were before."""
    import torch
    with torch.random.fork_rng(devices=devs):
        seed_devices(seed, devs)
        yield
