"""The episode lifecycle (tasks.envs.shard, its mode table) through every rollout path, on a fake simulator.

Table: auto_reset x ignore_terminations x episode length vs the rollout (shorter, ending mid-chunk; aligned with
it; longer) x GRPO groups of 2 whose members end at different steps (or no groups, PPO with action-level
rewards) x path (colocated env_step; disaggregated env_observe + policy_infer + env_step_chunk; disaggregated
with 2 pipeline stages; colocated on a BatchedEnvShard). Each row runs 3 rollouts of the rollout functions
directly (resident registry in-process, no Dask) and checks, per chunk step and env, against a reference loop
written from the mode table: the seeds, the observation each executed chunk was chosen from (the fake env logs
the (seed, step) at which every action reaches it), step masks, done flags, finished episodes, loss masks
(tasks.actor.entries.advantages) and GRPO group membership (members share every reset seed). GRPO rows whose rollouts
can start mid-episode must be refused offline instead (tasks.config.check_grpo_episodes).

Then: exact resume from a cursor (shard level and rollout level, with sampled actions), the batched shard's
documented restart, the first shard's draws equal to the former global seeding, non-finite values.
"""
from __future__ import annotations

import itertools
import json
import warnings

import numpy as np
import pytest
import torch

import tasks.rollout as rollout
from tasks import resident
from tasks.actor import entries
from tasks.config import Config, ConfigError, replace_keys
from tasks.envs.batched import BatchedEnvShard
from tasks.envs.shard import EnvShard
from tasks.config import check_config

RUN = "lifecycle"
N, S, T, C = 8, 2, 4, 2  # envs, shards, chunk steps per rollout, actions per chunk
B = N // S
BASE = 100
ROLLOUTS = 3
TERM = {0: 2, 1: 5, 2: None, 3: 13}  # termination step by g % 4 (None: never): group members (2g, 2g+1) differ
LENGTHS = {"shorter": 3, "aligned": 4, "longer": 11}  # time limit L vs the rollout's T*C = 8 actions


class LifeEnv:
    """obs = [seed, t, 1] (t = actions since the reset); reward = sum of the action; terminated (and success) at
    t = TERM[g % 4], truncated at t = limit. Logs every reset seed and every action that reaches it with the
    (seed, t) it met. Optional images: [t, seed % 256, 7] everywhere."""

    obs_dim, action_dim = 3, 2

    def __init__(self, g: int, limit: int, images: bool = False, term=TERM):
        self.g, self.limit, self.term_at = g, limit, term[g % 4]
        self.image_shape = (2, 2, 3) if images else None
        self.t, self.seed = 0, 0
        self.resets: list[int] = []
        self.log: list[tuple[int, int, np.ndarray]] = []
        self.nan_at: tuple[str, int] | None = None  # ("obs" | "rewards", t): return NaN there

    def _obs(self):
        return np.array([self.seed, self.t, 1.0], np.float32)

    def reset(self, seed):
        self.t, self.seed = 0, int(seed)
        self.resets.append(int(seed))
        return self._obs()

    def step(self, action):
        assert action.shape == (2,) and action.dtype == np.float32 and np.isfinite(action).all()
        self.log.append((self.seed, self.t, action.copy()))
        self.t += 1
        term = self.term_at == self.t
        obs, r = self._obs(), float(action.sum())
        if self.nan_at == ("obs", self.t):
            obs[0] = np.nan
        if self.nan_at == ("rewards", self.t):
            r = float("nan")
        return obs, r, term, self.t >= self.limit, term

    def render_rgb(self):
        return np.array([self.t, self.seed % 256, 7], np.uint8).reshape(1, 1, 3).repeat(2, 0).repeat(2, 1)

    def close(self):
        pass


class LifeBatched:
    """The BatchedEnv protocol over LifeEnvs: every env steps at every call (discarded ones with zero actions)."""

    obs_dim, action_dim = 3, 2

    def __init__(self, envs):
        self.envs, self.num_envs = envs, len(envs)
        self.image_shape = envs[0].image_shape

    def reset(self, seeds, env_idx):
        return np.stack([self.envs[i].reset(s) for s, i in zip(seeds, env_idx)])

    def step(self, actions):
        out = [e.step(a) for e, a in zip(self.envs, actions)]
        return tuple(np.array([o[i] for o in out]) for i in range(5))

    def render_rgb(self):
        return np.stack([e.render_rgb() for e in self.envs])

    def close(self):
        pass


@pytest.fixture
def sim(monkeypatch):
    """Replace tasks.rollout.make_shard with LifeEnv shards; `sim.envs[g]` is global env g's latest instance."""

    class Sim:
        envs: dict[int, LifeEnv] = {}
        batched = False
        images = False

    def make_shard(e, *, shard, num_shards, num_envs, auto_reset, ignore_terminations, base_seed,
                   episode_count=None, seed_fn=None, group_size=1):
        size = num_envs // num_shards
        envs = [LifeEnv(shard * size + i, e.max_episode_steps, Sim.images) for i in range(size)]
        Sim.envs.update({shard * size + i: env for i, env in enumerate(envs)})
        kw = dict(env_offset=shard * size, num_envs_total=num_envs, base_seed=base_seed, auto_reset=auto_reset,
                  ignore_terminations=ignore_terminations, episode_count=episode_count, seed_fn=seed_fn,
                  group_size=group_size)
        return BatchedEnvShard(LifeBatched(envs), **kw) if Sim.batched else EnvShard(envs, **kw)

    monkeypatch.setattr(rollout, "make_shard", make_shard)
    monkeypatch.setattr(rollout, "instructions", lambda cfg: ("",))
    resident.release("")
    yield Sim
    resident.release("")


def make_config(auto_reset: bool, ignore: bool, L: int, grpo: bool, path: str = "colocated",
                reward_type: str | None = None) -> Config:
    keys = {"env.num_envs": N, "env.num_shards": S, "env.seed": BASE, "env.auto_reset": auto_reset,
            "env.ignore_terminations": ignore, "env.max_episode_steps": L,
            "policy.hidden_sizes": [8], "policy.num_action_chunks": C,
            "rollout.chunk_steps": T, "rollout.chunk_steps_per_node": 2,  # colocated: 2 segments per rollout
            "algorithm.num_minibatches": 2, "algorithm.update_epochs": 1}
    if path in ("disaggregated", "stages"):
        keys.update({"rollout.inference": "disaggregated", "rollout.pipeline_stage_num": 2 if path == "stages" else 1})
    if grpo:
        keys.update({"algorithm.name": "grpo", "algorithm.group_size": 2})
    else:  # PPO rows also cover action-level rewards on idle envs (they crashed)
        keys["algorithm.reward_type"] = keys["algorithm.logprob_type"] = reward_type or "action_level"
    return check_config(replace_keys(Config(), keys))


def run_rollouts(cfg: Config, n: int, cursors=None, weights=None) -> list[list[dict]]:
    """n rollouts of every shard through the path of `cfg`, as the step graphs call the task functions."""
    if weights is None:
        weights = entries.actor_init(cfg, RUN, (3, 2))
    cursors = list(cursors or [None] * S)
    out = []
    for _ in range(n):
        if cfg.rollout.inference == "colocated":
            nseg, per = cfg.num_segments, cfg.rollout.chunk_steps_per_node
            trajs = [rollout.trajectory(*[rollout.env_step(cfg, RUN, s, weights, per, cursors[s], k == 0, None,
                                                           k == nseg - 1) for k in range(nseg)]) for s in range(S)]
        else:
            p = cfg.rollout.pipeline_stage_num
            parts: list[list] = [[] for _ in range(S)]
            for j in range(p):
                stage = () if p == 1 else (j,)
                last = [rollout.env_observe(cfg, RUN, s, cursors[s], True, *stage) for s in range(S)]
                chains = [[o] for o in last]
                for t in range(T + 1):
                    inf = rollout.policy_infer(cfg, RUN, weights, (3, 2), t < T, *last)
                    for s in range(S):
                        chains[s].append(inf)
                    if t == T:
                        break
                    last = [rollout.env_step_chunk(cfg, RUN, s, inf, cursors[s], *stage) for s in range(S)]
                    for s in range(S):
                        chains[s].append(last[s])
                for s in range(S):
                    parts[s].append(chains[s])
            trajs = [rollout.trajectory_disaggregated(cfg, s, *parts[s][0]) if p == 1 else
                     rollout.trajectory_stages(cfg, s, p, *(x for c in parts[s] for x in c)) for s in range(S)]
        cursors = [t["cursor"] for t in trajs]
        out.append(trajs)
    return out


def reference(cfg: Config) -> dict:
    """The mode table as a plain loop: per rollout n, chunk step j, global env g the expected episode."""
    e, gs = cfg.env, cfg.algorithm.group_size if cfg.algorithm.name == "grpo" else 1
    L = e.max_episode_steps
    shape = (ROLLOUTS, T, N)
    ref = {"active": np.zeros(shape, bool), "seed": np.full(shape, -1), "t": np.zeros(shape, int),
           "n_exec": np.zeros(shape, int), "terminated": np.zeros(shape, bool), "truncated": np.zeros(shape, bool),
           "obs": np.zeros((*shape, 3), np.float32), "episodes": [set() for _ in range(ROLLOUTS)],
           "first_done": np.full((ROLLOUTS, N), T - 1)}
    for g in range(N):
        term = None if e.ignore_terminations else TERM[g % 4]
        end = term if term is not None and term <= L else L  # termination wins a tie with the time limit
        k, t, active, seed = 0, 0, True, None
        for n in range(ROLLOUTS):
            if n > 0 and not e.auto_reset:  # DISABLED: new episodes; an open one is cut and consumes its seed
                k += int(active)
                t, active = 0, True
            done_seen = False
            for j in range(T):
                if active:
                    seed = BASE + g // gs + k * (N // gs)
                    ref["active"][n, j, g], ref["seed"][n, j, g], ref["t"][n, j, g] = True, seed, t
                    ref["obs"][n, j, g] = [seed, t, 1]
                    ne = min(C, end - t)
                    ref["n_exec"][n, j, g] = ne
                    t += ne
                    if t == end:
                        ref["terminated" if end == term else "truncated"][n, j, g] = True
                        ref["episodes"][n].add((g, seed, end))
                        if not done_seen:
                            ref["first_done"][n, g], done_seen = j, True
                        k += 1
                        if e.auto_reset:
                            t = 0
                        else:
                            active = False
                else:  # idle: its episode's final observation
                    ref["obs"][n, j, g] = [seed, t, 1]
    return ref


PATHS = ["colocated", "disaggregated", "stages", "batched"]
ROWS = list(itertools.product([True, False], [True, False], list(LENGTHS), [False, True], PATHS))


def _row_id(row):
    auto, ignore, length, grpo, path = row
    return f"{'auto' if auto else 'noauto'}-{'ignore' if ignore else 'term'}-{length}-{'grpo' if grpo else 'ppo'}-{path}"


@pytest.mark.parametrize("row", ROWS, ids=[_row_id(r) for r in ROWS])
def test_lifecycle_table(sim, row):
    auto, ignore, length, grpo, path = row
    L = LENGTHS[length]
    aligned = ignore and L % C == 0 and T % (L // C) == 0
    if grpo and auto and not aligned:  # rollouts could start mid-episode: refused offline, naming the key
        with pytest.raises(ConfigError, match=r"env\.auto_reset=True: GRPO .* env\.auto_reset=false"):
            make_config(auto, ignore, L, grpo, "colocated" if path == "batched" else path)
        return
    sim.batched = path == "batched"
    cfg = make_config(auto, ignore, L, grpo, "colocated" if path == "batched" else path)
    ref = reference(cfg)
    out = run_rollouts(cfg, ROLLOUTS)
    executed = {g: [] for g in range(N)}  # per env, (seed, t, clipped action) of every executed action, in order
    for n, trajs in enumerate(out):
        episodes = set()
        for s, tr in enumerate(trajs):
            g = slice(s * B, (s + 1) * B)
            np.testing.assert_array_equal(tr["episode_seed"], ref["seed"][n, :, g], err_msg=f"seeds rollout {n}")
            np.testing.assert_array_equal(tr["obs"], ref["obs"][n, :, g], err_msg=f"obs rollout {n}")
            mask = np.arange(C)[None, None, :] < ref["n_exec"][n, :, g][..., None]
            np.testing.assert_array_equal(tr["step_mask"], mask, err_msg=f"step_mask rollout {n}")
            np.testing.assert_array_equal(tr["terminated"], ref["terminated"][n, :, g])
            np.testing.assert_array_equal(tr["truncated"], ref["truncated"][n, :, g])
            assert (tr["rewards"][~mask] == 0).all()
            episodes |= {(ep["env"], ep["seed"], ep["episode_len"]) for ep in tr["episodes"]}
            for j, b, c in zip(*np.nonzero(mask)):
                executed[s * B + b].append((tr["episode_seed"][j, b], tr["obs"][j, b, 1] + c,
                                            np.clip(tr["actions"][j, b, c], -1, 1)))
            adv = entries.advantages(cfg, tr)  # loss masks (and no crash on idle envs with action-level rewards)
            if grpo:  # each env's first episode of the rollout, which starts at chunk step 0
                assert (ref["t"][n, 0, g] == 0).all()
                first = ref["first_done"][n, g]
                np.testing.assert_array_equal(adv["loss_mask"], np.arange(T)[:, None] <= first[None, :])
                # group membership: the members of a group share the rollout's reset seed
                seeds0 = tr["episode_seed"][0].reshape(-1, 2)
                assert (seeds0[:, 0] == seeds0[:, 1]).all() and len(set(seeds0[:, 0])) == B // 2
            else:
                np.testing.assert_array_equal(adv["loss_mask"], mask.any(-1))
                assert np.isfinite(adv["advantages"]).all() and adv["advantages"].shape == (T, B, C)
        assert episodes == ref["episodes"][n], f"finished episodes of rollout {n}"
        if not auto and n > 0:  # a new rollout never restarts from the seeds of the previous one
            prev = np.concatenate([t["episode_seed"][0] for t in out[n - 1]])
            cur = np.concatenate([t["episode_seed"][0] for t in trajs])
            assert not (prev == cur).any()
    # every executed chunk ran in the episode (seed) and at the step its observation showed, with its own actions
    for g, env in sim.envs.items():
        log = [x for x in env.log if (x[2] != 0).any()] if sim.batched else env.log  # batched: drop idle no-ops
        assert len(log) == len(executed[g]), g
        for (seed_e, t_e, a_e), (seed_o, t_o, a_o) in zip(log, executed[g]):
            assert (seed_e, t_e) == (seed_o, t_o)
            np.testing.assert_array_equal(a_e, a_o)
    # group members share every reset seed (one's reset list is a prefix of the other's; equal without auto_reset)
    gs = cfg.algorithm.group_size if grpo else 1
    for g0 in range(0, N, gs):
        lists = [sim.envs[g].resets for g in range(g0, g0 + gs)]
        m = min(map(len, lists))
        assert all(r[:m] == lists[0][:m] for r in lists)
        if not auto:
            assert all(r == lists[0] for r in lists) and len(lists[0]) == ROLLOUTS
    if grpo and not ignore:  # the table row has groups whose members end at different steps
        assert (ref["first_done"][0, 0::2] != ref["first_done"][0, 1::2]).any()


def test_action_level_update_on_idle_envs(sim):
    """Issue 9.1 (3): action-level rewards and log-probs without auto_reset, envs idle for most of the rollout:
    advantages and the update run, and idle chunk steps stay out of the loss."""
    cfg = make_config(False, False, 3, False)
    w = entries.actor_init(cfg, RUN, (3, 2))
    trajs = run_rollouts(cfg, 1, weights=w)[0]
    assert any((~t["step_mask"].any(-1)).any() for t in trajs)  # there are idle chunk steps
    advs = [entries.advantages(cfg, t) for t in trajs]
    out = entries.actor_update(cfg, RUN, w, *advs)
    assert out["version"] == 1 and np.isfinite(out["metrics"]["train/actor_loss"])


def test_cut_episodes_are_not_reported_and_consume_their_seed(sim):
    cfg = make_config(False, True, 11, False)
    out = run_rollouts(cfg, 2)
    for trajs in out:
        assert all(t["episodes"] == [] for t in trajs)  # 11-step episodes, 8-action rollouts: all cut
    assert [int(out[1][s]["episode_seed"][0, 0]) for s in range(S)] == [BASE + s * B + N for s in range(S)]
    assert out[1][0]["cursor"]["episode_count"] == [1] * B  # the cut episode counted; the open one not yet


# ----- resume from a cursor -----
def _actions(rng, n):
    return rng.uniform(-1.2, 1.2, (n, B, C, 2)).astype(np.float32)


def _results_equal(a, b):
    for f in ("obs", "rewards", "terminated", "truncated", "step_mask", "success", "final_obs", "episode_seed",
              "episode_id", "rgb", "final_rgb"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    assert a.episodes == b.episodes


def _shard(auto, ignore, images, L=5, batched=False):
    envs = [LifeEnv(4 + i, L, images) for i in range(B)]
    kw = dict(env_offset=4, num_envs_total=N, base_seed=BASE, auto_reset=auto, ignore_terminations=ignore)
    return (BatchedEnvShard(LifeBatched(envs), **kw) if batched else EnvShard(envs, **kw)), envs


@pytest.mark.parametrize("auto, ignore, images, k", [(True, False, True, 3), (True, True, False, 4),
                                                     (False, False, True, 3), (False, True, False, 2),
                                                     (False, False, False, 0), (True, False, False, 1)])
def test_a_shard_built_from_a_cursor_continues_exactly(auto, ignore, images, k):
    rng = np.random.default_rng(k)
    a, _ = _shard(auto, ignore, images)
    acts = _actions(rng, k + 6)
    a.begin_rollout()
    for t in range(k):
        a.chunk_step(acts[t])
    cur = a.state_dict()
    # JSON- and weights_only-safe; a copy, not a view of the shard
    assert json.loads(json.dumps(cur)) == cur
    b, envs = _shard(auto, ignore, images)
    b.load_state_dict(json.loads(json.dumps(cur)))
    if k:  # the open episodes were re-simulated: reset(seed) + their actions, not restarted
        assert all(len(e.log) == len(x) for e, x in zip(envs, cur["actions"]))
    np.testing.assert_array_equal(a.current_obs(), b.current_obs())
    if images:
        np.testing.assert_array_equal(a.current_rgb(), b.current_rgb())
    for t in range(k, k + 6):
        if t == k + 3:  # a rollout boundary after the resume (DISABLED: cut + new episodes)
            a.begin_rollout(), b.begin_rollout()
        _results_equal(a.chunk_step(acts[t]), b.chunk_step(acts[t]))
    assert a.state_dict() == b.state_dict()


def test_cursor_survives_a_weights_only_checkpoint(tmp_path):
    a, _ = _shard(True, False, False)
    a.seed_rng(3)
    with a.policy_rng():
        torch.rand(2)
    a.chunk_step(_actions(np.random.default_rng(0), 1)[0])
    cur = a.state_dict()
    torch.save({"cursors": [cur]}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt", weights_only=True)["cursors"][0] == cur


def test_batched_shard_restarts_open_episodes_from_reset():
    """GPU physics cannot be replayed: a BatchedEnvShard from a cursor keeps the counts, seeds and idle flags, and
    restarts every env's episode from its reset (same seed and episode id), with a warning."""
    rng = np.random.default_rng(0)
    a, _ = _shard(False, False, False, batched=True)
    a.begin_rollout()
    for t in range(2):  # env 4 (TERM 2) has finished and idles; the others are 4 steps into their episodes
        a.chunk_step(_actions(rng, 1)[0])
    cur = a.state_dict()
    assert cur["actions"] == [[]] * B and cur["active"] == [False, True, True, True]
    b, envs = _shard(False, False, False, batched=True)
    with pytest.warns(RuntimeWarning, match=r"global envs \[4, 5, 6, 7\] restart from their reset"):
        b.load_state_dict(cur)
    assert [e.resets for e in envs] == [[s] for s in cur["seed"]]
    np.testing.assert_array_equal(b.current_obs(), [[s, 0, 1] for s in cur["seed"]])
    assert b.active.tolist() == cur["active"] and b.ep_len.tolist() == [0] * B
    assert b.state_dict()["episode_count"] == cur["episode_count"]
    res = b.chunk_step(_actions(rng, 1)[0])
    assert res.episode_seed.tolist() == [-1, *cur["seed"][1:]]
    assert not res.step_mask[0].any() and res.step_mask[1:].all()
    # a never-started cursor loads without a warning
    c, _ = _shard(False, False, False, batched=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.load_state_dict(_shard(False, False, False, batched=True)[0].state_dict())


@pytest.mark.parametrize("path", ["colocated", "disaggregated", "stages"])
@pytest.mark.parametrize("auto", [True, False])
@pytest.mark.parametrize("fresh_worker", [True, False])
def test_rollouts_resumed_from_cursors_equal_the_uninterrupted_ones(sim, auto, fresh_worker, path):
    """3 rollouts == 1 rollout, shards re-created from its cursors (and, fresh_worker, the replica too), 2 more:
    every field identical, the sampled actions included (MLP policy; colocated: per-shard RNG streams carried in
    the cursor; disaggregated: draws seeded from the shards' cursors)."""
    cfg = make_config(auto, False, 5, False, path, reward_type="chunk_level")
    w = entries.actor_init(cfg, RUN, (3, 2))
    full = run_rollouts(cfg, 3, weights=w)
    resident.release("")
    first = run_rollouts(cfg, 1, weights=w)[0]
    resident.release(f"{RUN}/shard") if not fresh_worker else resident.release("")
    cursors = [json.loads(json.dumps(t["cursor"])) for t in first]
    rest = run_rollouts(cfg, 2, cursors=cursors, weights=w)
    for n, trajs in enumerate([first, *rest]):
        for s, (a, b) in enumerate(zip(full[n], trajs)):
            for k in rollout.step_fields(a) + ["bootstrap_values"]:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"rollout {n} shard {s} {k}")
            assert a["episodes"] == b["episodes"] and a["cursor"] == b["cursor"]
    # the two shards of one worker draw different noise
    assert not np.array_equal(full[0][0]["actions"], full[0][1]["actions"])


def test_first_shard_draws_equal_the_former_global_seeding(sim):
    """A fresh run's exploration noise is unchanged: the former code seeded torch globally at the shard's creation
    (seed * 100_003 + part * 7_919 + sum of episode counts), then the worker's replica was built, then it drew."""
    from tasks.policies import make_policy
    cfg = make_config(True, True, 11, False, reward_type="chunk_level")
    w = entries.actor_init(cfg, RUN, (3, 2))
    traj = run_rollouts(cfg, 1, weights=w)[0][0]
    torch.manual_seed(cfg.seed * 100_003 + 0 * 7_919 + 0)
    pol = make_policy(cfg.policy, obs_dim=3, action_dim=2, num_values=1, load=False)
    pol.load_state_dict(w["state_dict"])
    pol.eval()
    with torch.no_grad():
        out = pol.act({"state": torch.as_tensor(traj["obs"][0])})
    np.testing.assert_array_equal(out["actions"].numpy(), traj["actions"][0])


# ----- non-finite values never reach (or leave) the simulator unnoticed -----
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("field_", ["actions", "obs", "rewards"])
def test_non_finite_values_fail_with_one_line(batched, field_):
    sh, envs = _shard(True, True, False, L=50, batched=batched)
    rng = np.random.default_rng(0)
    sh.begin_rollout()
    sh.chunk_step(_actions(rng, 1)[0])
    acts = _actions(rng, 1)[0]
    if field_ == "actions":
        acts[2, 1, 0] = np.nan  # env 6, its chunk's 2nd action
    else:
        envs[2].nan_at = (field_, 3)  # env 6 returns NaN at its 3rd step (chunk step 1, action 0)
    steps = [len(e.log) for e in envs]
    with pytest.raises(ValueError) as err:
        sh.chunk_step(acts)
    msg = str(err.value)
    assert "\n" not in msg and f"non-finite {field_}" in msg and f"field {field_}" in msg
    assert "global envs 4..7" in msg and "env 6," in msg and "chunk step 1 of the rollout" in msg
    if field_ == "actions":  # before stepping anything
        assert [len(e.log) for e in envs] == steps


def test_non_finite_actions_of_idle_envs_are_not_an_error():
    sh, envs = _shard(False, False, False)
    sh.begin_rollout()
    rng = np.random.default_rng(0)
    sh.chunk_step(_actions(rng, 1)[0])  # env 4 terminated at step 2: idle
    acts = _actions(rng, 1)[0]
    acts[0] = np.nan
    res = sh.chunk_step(acts)
    assert not res.step_mask[0].any() and len(envs[0].log) == 2


def test_maniskill_shard_resumes_mid_episode_exactly():
    """On the real CPU simulator (deterministic: reset(seed) + the same actions): a shard built from a JSON'd
    cursor taken mid-episode continues bit-identically, across an automatic reset too."""
    pytest.importorskip("mani_skill")
    from tasks.envs.maniskill.configuration import ManiSkillEnvConfig
    from tasks.envs import make_shard
    cfg = ManiSkillEnvConfig(max_episode_steps=12)
    kw = dict(shard=0, num_shards=1, num_envs=2, auto_reset=True, ignore_terminations=True, base_seed=3)
    a = make_shard(cfg, **kw)
    acts = np.random.default_rng(0).uniform(-1, 1, (12, 2, 2, a.action_dim)).astype(np.float32)
    a.begin_rollout()
    for t in range(4):  # 8 of the 12 steps
        a.chunk_step(acts[t])
    b = make_shard(cfg, **kw)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    np.testing.assert_array_equal(a.current_obs(), b.current_obs())
    for t in range(4, 12):  # the episodes end at chunk step 5 and restart
        _results_equal(a.chunk_step(acts[t]), b.chunk_step(acts[t]))
    assert a.state_dict() == b.state_dict()
    a.close(), b.close()
