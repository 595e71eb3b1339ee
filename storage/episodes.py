"""The episode index of a trajectory store: which chunk steps of which env belong to which episode.

Read by `pipelines.replay` (and anything else that walks a store episode by episode). Only complete steps
(`TrajectoryStore.complete_steps()`) are indexed. Episode k of global env g has id g + k * num_envs; an episode is
complete when its last stored chunk step has `terminated` or `truncated`, else partial; its start is known when it
is the run's first chunk step or directly follows another episode's end in the same env (else tasks.replay decides
from the reset observation). Positions flatten (complete step i, chunk step t) to p = i * T + t.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

INDEX_FIELDS = ("episode_id", "episode_seed", "step_mask", "terminated", "truncated", "success")


@dataclass
class StoreIndex:
    """Per-step bookkeeping of the complete steps, flattened per env to positions p = i * T + t.

    `steps[i]` is the i-th complete step; arrays are [P, B] (`step_mask` [P, B, C]) with P = len(steps) * T.
    `contiguous[p]` is True when position p directly follows p - 1 in the run (no missing step in between).
    """

    steps: np.ndarray
    T: int
    num_envs: int
    episode_id: np.ndarray
    episode_seed: np.ndarray
    step_mask: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    success: np.ndarray
    contiguous: np.ndarray

    def step_t(self, p: int) -> tuple[int, int]:
        return int(self.steps[p // self.T]), p % self.T


@dataclass
class Episode:
    """One episode id's chunk steps in the store (positions of executed chunk steps, in run order)."""

    id: int
    env: int
    seed: int
    positions: list[int]
    known_start: bool  # the first position is certainly the episode's reset
    complete: bool
    notes: list[str] = field(default_factory=list)


def load_index(store) -> StoreIndex:
    """The StoreIndex of `store`'s complete steps (a storage.trajectories.TrajectoryStore: reads INDEX_FIELDS)."""
    steps = store.complete_steps()
    T, B = store.T, store.num_envs
    data = {f: store.read(f, steps) for f in INDEX_FIELDS}
    P = len(steps) * T
    flat = {f: v.reshape(P, B, *v.shape[3:]) for f, v in data.items()}
    contiguous = np.ones(P, bool)
    if P:
        contiguous[0] = False
        for i in range(1, len(steps)):
            contiguous[i * T] = bool(steps[i] == steps[i - 1] + 1)
    return StoreIndex(steps, T, B, contiguous=contiguous, **flat)


def find_episodes(idx: StoreIndex) -> dict[int, Episode]:
    """Every episode id with at least one executed action in the complete steps, in order of first step."""
    P, B = idx.episode_id.shape
    done = idx.terminated | idx.truncated
    executed = idx.step_mask.any(axis=-1)  # idle envs (auto_reset=false, episode over) ran nothing
    found: list[tuple[tuple[int, int], Episode]] = []
    for b in range(B):
        pos = np.flatnonzero(executed[:, b] & (idx.episode_id[:, b] >= 0))
        if pos.size == 0:
            continue
        ids = idx.episode_id[pos, b]
        order = np.argsort(ids, kind="stable")  # grouped by id, run order kept inside each group
        groups = np.split(pos[order], np.flatnonzero(np.diff(ids[order])) + 1)
        for g in groups:
            p0, eid = int(g[0]), int(idx.episode_id[g[0], b])
            run_first = p0 == 0 and int(idx.steps[0]) == 0
            after_other = (p0 > 0 and bool(idx.contiguous[p0]) and int(idx.episode_id[p0 - 1, b]) != eid
                           and bool(done[p0 - 1, b]))
            ep = Episode(eid, b, int(idx.episode_seed[p0, b]), g.tolist(), run_first or after_other,
                         bool(done[g[-1], b]))
            found.append(((p0, b), ep))
    found.sort(key=lambda x: x[0])
    return {ep.id: ep for _, ep in found}


@dataclass
class EpisodeData:
    """Stored obs [P_e, O], actions [P_e, C, D], rewards [P_e, C] of one env at the positions of an episode."""

    obs: dict[int, np.ndarray]
    actions: dict[int, np.ndarray]
    rewards: dict[int, np.ndarray]


def read_episode_data(store, idx: StoreIndex, ep: Episode) -> EpisodeData:
    """obs / actions / rewards of `ep`'s env at its positions and the one after (the observation after its last
    chunk step), read from `store`'s complete steps."""
    pos = ep.positions + [ep.positions[-1] + 1]  # the next chunk step holds the observation after the last one
    pos = [p for p in pos if p < len(idx.steps) * idx.T]
    ei = sorted({p // idx.T for p in pos})
    steps = [int(idx.steps[i]) for i in ei]
    local = {i: j for j, i in enumerate(ei)}
    arrays = {f: store.read(f, steps)[:, :, ep.env] for f in ("obs", "actions", "rewards")}
    out = EpisodeData({}, {}, {})
    for p in pos:
        j, t = local[p // idx.T], p % idx.T
        out.obs[p], out.actions[p], out.rewards[p] = (arrays["obs"][j, t], arrays["actions"][j, t],
                                                      arrays["rewards"][j, t])
    return out


def stored_outcomes(store, idx: StoreIndex, episodes: dict[int, Episode]) -> dict[int, tuple[float, bool]]:
    """episode id -> (stored return: the sum of its executed actions' rewards, success_once: `success` at any of
    its chunk steps), from `store`'s complete steps (one read of `rewards`)."""
    rewards = store.read("rewards", idx.steps)  # [S, T, B, C]
    rewards = rewards.reshape(len(idx.steps) * idx.T, idx.num_envs, *rewards.shape[3:])  # -> [P, B, C]
    out = {}
    for eid, ep in episodes.items():
        p, b = ep.positions, ep.env
        out[eid] = (float((rewards[p, b] * idx.step_mask[p, b]).sum()), bool(idx.success[p, b].any()))
    return out


WATCH_ORDER = ("highest-return success", "lowest-return failure", "highest return left", "lowest return left")


def worth_watching(outcomes: dict[int, tuple[float, bool]]) -> list[tuple[int, str]]:
    """Every episode of `outcomes` (id -> (return, success)) in the order worth watching, each with why it is
    there: first the successful episode with the highest return, then the failed one with the lowest return
    (ties: the lower id; either is left out when there is no success / no failure), then the rest alternately
    from the top and the bottom of the ranking by return (highest first, the lower id first on ties).
    Deterministic; a caller takes a prefix."""
    ranked = sorted(outcomes, key=lambda e: (-outcomes[e][0], e))  # highest return first
    best = next((e for e in ranked if outcomes[e][1]), None)
    worst = next((e for e in sorted(outcomes, key=lambda e: (outcomes[e][0], e)) if not outcomes[e][1]), None)
    picked = [(e, why) for e, why in ((best, WATCH_ORDER[0]), (worst, WATCH_ORDER[1])) if e is not None]
    rest = [e for e in ranked if e not in (best, worst)]
    for k in range(len(rest)):  # top, bottom, second from the top, ...
        picked.append((rest[k // 2], WATCH_ORDER[2]) if k % 2 == 0 else (rest[len(rest) - 1 - k // 2], WATCH_ORDER[3]))
    return picked


def no_complete_note(env_id: str, max_episode_steps: int | None, C: int, steps: int, T: int, ids: list[int]) -> str:
    """Why a store has no complete episode, and what to do: an episode of `env_id` lasts up to `max_episode_steps`
    env steps (None: until it ends), i.e. ceil(max_episode_steps / C) chunk steps of `C` actions, and the store's
    `steps` complete training steps hold steps x T chunk steps per env (T = rollout.chunk_steps)."""
    held = f"the store holds {steps * T} chunk steps per env ({steps} training step(s) of rollout.chunk_steps={T})"
    if max_episode_steps:
        chunks = -(-int(max_episode_steps) // C)  # ceil: the last chunk may run fewer actions
        length = (f"a {env_id} episode lasts up to {max_episode_steps} env steps ({chunks} chunk steps of {C} "
                  f"action(s)) unless it ends earlier")
        store = (f"; a run with runner.max_steps x rollout.chunk_steps >= {chunks} stores complete ones")
    else:
        length, store = f"a {env_id} episode lasts until it ends", ""
    return (f"no episode is complete in the store: {length}, and {held}; replayed the partial episodes instead "
            f"(--episodes IDS picks any of ids {id_ranges(sorted(ids))}){store}")


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5" (sorted ids)."""
    parts: list[list[int]] = []
    for i in ids:
        if parts and i == parts[-1][1] + 1:
            parts[-1][1] = i
        else:
            parts.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts) or "none"
