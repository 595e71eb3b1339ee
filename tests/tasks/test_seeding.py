"""tasks.seeding: every seed rule against its formula on small hand-computed cases, and the call sites using it.

The numbers below are written out by hand from the table in tasks/seeding.py's docstring (never pasted outputs),
so a changed formula fails here before it silently moves every run's numbers.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks import seeding


class _Env:
    """Minimal single env for EnvShard construction (obs = [seed])."""
    obs_dim, action_dim = 1, 1

    def reset(self, seed):
        return np.array([seed], np.float32)

    def close(self):
        pass


@pytest.mark.parametrize("base, g, k, n, group, expected", [
    (10, 5, 2, 8, 1, 10 + 5 + 2 * 8),           # 31: every env its own seed
    (10, 5, 0, 8, 1, 15),
    (10, 4, 2, 8, 2, 10 + 2 + 2 * 4),           # 20: group j = 2, N // G = 4 groups
    (10, 5, 2, 8, 2, 20),                       # the other member of group 2: the same seed
    (0, 7, 3, 8, 4, 0 + 1 + 3 * 2),             # 7: group 1 of 2, 4th episode
])
def test_episode_seed(base, g, k, n, group, expected):
    assert seeding.episode_seed(base, g, k, n, group) == expected


def test_group_members_share_every_seed_and_groups_differ():
    N, G, base = 8, 2, 100
    seeds = {(g, k): seeding.episode_seed(base, g, k, N, G) for g in range(N) for k in range(3)}
    for (g, k), s in seeds.items():
        assert s == seeds[(g - g % G, k)]  # shares its group leader's seed
    leaders = [seeds[(g, k)] for g in range(0, N, G) for k in range(3)]
    assert len(set(leaders)) == len(leaders)  # (group, episode) pairs all distinct


def test_episode_id_and_its_seed_relation():
    assert seeding.episode_id(5, 2, 8) == 5 + 16
    assert seeding.episode_id(0, 0, 8) == 0
    # with group size 1, seed = base_seed + episode id (what replay checks)
    for g in range(4):
        for k in range(3):
            assert seeding.episode_seed(50, g, k, 4) == 50 + seeding.episode_id(g, k, 4)


def test_eval_seeds():
    assert seeding.eval_episode_seed(100, 7) == 107
    n = 4  # eval episode i on eval env i % n, its (i // n)-th episode: the train rule with G = 1
    assert all(seeding.eval_episode_seed(100, i) == seeding.episode_seed(100, i % n, i // n, n) for i in range(12))
    assert seeding.eval_torch_seed(100, 0) == 100
    assert seeding.eval_torch_seed(100, 2) == 100 + 2 * 7919


def test_shard_policy_seed():
    assert seeding.shard_policy_seed(3, 2, [1, 2]) == 3 * 100_003 + 2 * 7_919 + 3
    assert seeding.shard_policy_seed(3, 2, None) == 3 * 100_003 + 2 * 7_919
    assert seeding.shard_policy_seed(0, 0, []) == 0


def test_infer_seed_is_the_seed_sequence_hash():
    keys = [[0, 5], [4, 5]]
    expected = int(np.random.SeedSequence([7, 0, 5, 4, 5]).generate_state(2, np.uint64)[0]) >> 1
    assert seeding.infer_seed(7, keys) == expected
    assert 0 <= expected < 2 ** 63
    assert seeding.infer_seed(7 + 2 ** 32, keys) == expected  # words are taken mod 2^32
    assert seeding.infer_seed(7, [[0, 6], [4, 6]]) != expected  # the next chunk step: another stream
    assert seeding.infer_seed(7, [[0, 5]]) != expected  # another group


def test_update_seeds():
    assert seeding.permutation_seed(7, 3) == 7 * 1_000_003 + 3
    assert seeding.permutation_seed(2 ** 62, 3) == 3  # mod 2^62
    assert seeding.update_seed(7, 3, 1) == 7 * 1_000_033 + 3 * 8_191 + 131_071 * 2
    assert seeding.update_seed(7, 3) == 7 * 1_000_033 + 3 * 8_191 + 131_071
    assert seeding.update_seed(2 ** 62, 0, 0) == 131_071
    assert seeding.sft_load_seed(2, 5, 1) == 2 * 1_000_003 + 5 * 101 + 1
    assert seeding.model_init_seed(9) == 9


def test_benchmark_seeds():
    assert seeding.rl_signal_batch_seeds(0, 1) == (1001, 200_000)
    assert seeding.rl_signal_batch_seeds(5, 0) == (1000, 100_005)
    assert seeding.raw_env_seed(2, 3) == 2003


def test_forked_seeds_like_manual_seed_and_restores_the_stream():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with seeding.forked(42, []):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the process's stream is untouched
    torch.manual_seed(42)
    assert torch.equal(inside, torch.rand(3))


# ---------------------------------------------------------------- the call sites use the rules
def test_env_shard_default_rule_and_ids():
    from tasks.envs.shard import EnvShard
    sh = EnvShard([_Env() for _ in range(4)], env_offset=4, num_envs_total=8, base_seed=10, auto_reset=True,
                  ignore_terminations=False, episode_count=[0, 1, 2, 3], group_size=2)
    assert [sh.seed_fn(4 + b, k) for b, k in enumerate([0, 1, 2, 3])] == \
        [10 + 2, 10 + 2 + 4, 10 + 3 + 8, 10 + 3 + 12]
    sh.reset_all()
    assert sh.seed.tolist() == [12, 16, 21, 25]
    assert [sh._episode_id(b) for b in range(4)] == [4, 5 + 8, 6 + 16, 7 + 24]


def test_update_wrappers_take_the_config_seed():
    from tasks.actor import loop
    from tasks.config import Config
    cfg = Config(seed=11)
    assert loop.permutation_seed(cfg, 4) == 11 * 1_000_003 + 4
    assert loop.update_seed(cfg, 4, 1) == 11 * 1_000_033 + 4 * 8_191 + 2 * 131_071
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with loop.update_rng(cfg, 4, 1):
        drawn = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(loop.update_seed(cfg, 4, 1))
    assert torch.equal(drawn, torch.rand(2))


def test_no_seed_formula_outside_the_module():
    """The constants of the rules appear only in tasks/seeding.py (grep over tasks/, pipelines/, benchmarks/)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    constants = ("100_003", "7_919", "1_000_003", "1_000_033", "131_071", "8_191", "SeedSequence", "100_000 *")
    hits = []
    for d in ("tasks", "pipelines", "benchmarks"):
        for p in (root / d).rglob("*.py"):
            if p.name == "seeding.py":
                continue
            text = p.read_text()
            hits += [f"{p.relative_to(root)}: {c}" for c in constants if c in text]
    assert not hits, hits
