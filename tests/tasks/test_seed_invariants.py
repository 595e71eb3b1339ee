"""Seeds are distinct where the design needs them distinct (invariants instead of restated constants).

Every value below is computed by tasks.seeding's functions; the test never restates a formula or a constant. What
it asserts is what the rules are for (tasks/seeding.py's table, column "why"):
- the update's draws differ per (weight version, actor rank), its minibatch permutations per version;
- every (env, episode) of a training run has its own reset seed and id, GRPO group members share every seed and
  groups differ;
- eval episodes differ from each other, and at the shipped defaults from every training episode of a run;
- SFT loaders differ per (step, loader), colocated shard parts per part.
Sizes: far beyond the shipped experiments (thousands of versions, 8 ranks, 64 envs x hundreds of episodes).
"""
from __future__ import annotations

import itertools

import pytest

from tasks import seeding
from tasks.config import Config

VERSIONS, RANKS = 3000, 8
SEEDS = (0, 1, 7, 12345)


def _distinct(values) -> bool:
    values = list(values)
    return len(set(values)) == len(values)


@pytest.mark.parametrize("seed", SEEDS)
def test_update_draws_are_distinct_per_version_and_rank(seed):
    seeds = [seeding.update_seed(seed, v, r) for v, r in itertools.product(range(VERSIONS), range(RANKS))]
    assert _distinct(seeds)
    assert all(0 <= s for s in seeds)


@pytest.mark.parametrize("seed", SEEDS)
def test_minibatch_permutations_are_distinct_per_version(seed):
    assert _distinct(seeding.permutation_seed(seed, v) for v in range(VERSIONS))


@pytest.mark.parametrize("group_size", [1, 2, 4, 8])
def test_training_episodes_have_their_own_seeds_and_groups_share_theirs(group_size):
    base, N, K = Config().env.seed, 64, 300
    seed = {(g, k): seeding.episode_seed(base, g, k, N, group_size) for g in range(N) for k in range(K)}
    groups = {(g // group_size, k) for g, k in seed}
    # members of a group share the seed of every episode; distinct (group, episode) pairs have distinct seeds
    assert all(seed[g, k] == seed[g - g % group_size, k] for g, k in seed)
    assert len(set(seed.values())) == len(groups) == N // group_size * K
    ids = [seeding.episode_id(g, k, N) for g, k in seed]
    assert _distinct(ids)


def test_eval_episodes_are_distinct_and_apart_from_training_episodes_at_the_defaults():
    cfg = Config()
    evals = [seeding.eval_episode_seed(cfg.env.eval.seed, i) for i in range(1000)]
    vals = [seeding.eval_episode_seed(cfg.env.eval.val_seed, i) for i in range(1000)]
    assert _distinct(evals + vals)  # the validation split never replays an eval episode
    N = 64
    train = {seeding.episode_seed(cfg.env.seed, g, k, N) for g in range(N) for k in range(1000)}
    assert not train & set(evals + vals)


def test_eval_shards_draw_distinct_torch_streams():
    cfg = Config()
    assert _distinct(seeding.eval_torch_seed(cfg.env.eval.seed, s) for s in range(64))


@pytest.mark.parametrize("seed", SEEDS)
def test_sft_loaders_and_shard_parts_draw_distinct_streams(seed):
    assert _distinct(seeding.sft_load_seed(seed, step, loader) for step in range(2000) for loader in range(16))
    assert _distinct(seeding.shard_policy_seed(seed, part, None) for part in range(256))
