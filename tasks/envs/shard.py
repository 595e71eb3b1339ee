"""EnvShard: a vectorised group of single-env simulator instances living in one worker process.

The shard owns everything a simulator adapter should not have to repeat: seeds, episode bookkeeping, action
chunks, `auto_reset` and `ignore_terminations` (RLinf semantics), and the `final_info` metrics of every finished
episode (`success_once`, `success_at_end`, `return`, `episode_len`).

Seeds: episode k of global env g gets reset seed `seed_fn(g, k)`; the default is
`base_seed + g + k * num_envs_total`, so every (env, episode) pair has a unique, replayable seed and the cursor
(`episode_count` per env) is all a checkpoint needs to continue the sequence.

Action chunks (shape [B, C, D]): the C actions are executed in order. When an episode ends at action c < C-1
the remaining actions of that env are NOT executed (reward 0, `step_mask` False); the done flag is reported for
the chunk step. This differs from RLinf, which keeps stepping the finished env until the chunk ends; here the
post-episode actions never touch the simulator and are masked out of the loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np


class SingleEnv(Protocol):
    """One simulator instance (num_envs=1). Adapters implement this; the shard does the rest."""

    obs_dim: int
    action_dim: int

    def reset(self, seed: int) -> np.ndarray:
        """Reset with a seed; return the observation, float32 [obs_dim]."""

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, bool]:
        """Apply one action float32 [action_dim] in [-1, 1]; return (obs, reward, terminated, truncated, success)."""

    def close(self) -> None: ...

    # optional, for obs_mode=rgb: image_shape (H, W, 3) (None without images) and
    # render_rgb() -> uint8 [H, W, 3] of the current state; instruction: str (the env task's prompt)


@dataclass
class ChunkResult:
    """Outcome of one chunk step of a shard of B envs with chunks of C actions.

    obs [B, O] float32: observation after the chunk (after an automatic reset, if any).
    rewards [B, C] float32: per-action rewards (0 for actions not executed).
    terminated [B] bool, truncated [B] bool: the episode ended within this chunk (kept apart; never both).
    step_mask [B, C] bool: which actions were executed.
    success [B] bool: the success flag after the last executed action.
    final_obs [B, O] float32: the episode's last observation where it ended (zeros elsewhere), for
        bootstrapping V(final_obs) on truncation.
    episode_seed [B] int64, episode_id [B] int64: the episode this chunk step belonged to (-1 for idle envs).
    rgb [B, H, W, 3] uint8 or None: camera image of `obs` (envs with images only).
    final_rgb [B, H, W, 3] uint8 or None: image of `final_obs` where the episode was truncated (zeros elsewhere).
    episodes: one dict per finished episode: env, seed, episode_id, return, episode_len, success_once,
        success_at_end.
    """

    obs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    step_mask: np.ndarray
    success: np.ndarray
    final_obs: np.ndarray
    episode_seed: np.ndarray
    episode_id: np.ndarray
    episodes: list[dict] = field(default_factory=list)
    rgb: np.ndarray | None = None
    final_rgb: np.ndarray | None = None


class EnvShard:
    """B single envs stepped together with chunked actions.

    Args:
        envs: the simulator instances (same env task).
        env_offset: global index of envs[0] among all envs of the run (for seeds and episode ids).
        num_envs_total: number of envs in the run (seed stride).
        base_seed: see module docstring.
        auto_reset: reset an env right after its episode ends (its next chunk starts a new episode). When False,
            a finished env stays idle (step_mask False) until `reset_all`.
        ignore_terminations: ignore the simulator's `terminated`; episodes end only by truncation (time limit).
        episode_count: per-env cursor to continue a seed sequence (from a checkpoint); zeros by default.
        seed_fn: overrides the seed rule, (global_env, k) -> seed.
        group_size: envs per GRPO group: the `group_size` consecutive envs of a group share every reset seed,
            `base_seed + g // group_size + k * (num_envs_total // group_size)` (so the same initial state);
            1 = every env its own seed. A group must not straddle shards (ValueError).

    Images: envs with `image_shape` are rendered once per chunk step (after the chunk and after resets), not per
    simulator step; `rgb` [B, H, W, 3] uint8 is the image of `obs`.
    """

    def __init__(self, envs: Sequence[SingleEnv], *, env_offset: int, num_envs_total: int, base_seed: int,
                 auto_reset: bool, ignore_terminations: bool, episode_count: Sequence[int] | None = None,
                 seed_fn: Callable[[int, int], int] | None = None, group_size: int = 1):
        if not envs:
            raise ValueError("EnvShard needs at least one env")
        if group_size < 1 or len(envs) % group_size or env_offset % group_size or num_envs_total % group_size:
            raise ValueError(f"group_size={group_size} must divide the shard's {len(envs)} envs, its offset "
                             f"{env_offset} and the {num_envs_total} envs of the run (groups never straddle shards)")
        self.envs = list(envs)
        self.num_envs = len(self.envs)
        self.obs_dim, self.action_dim = self.envs[0].obs_dim, self.envs[0].action_dim
        self.env_offset, self.num_envs_total = env_offset, num_envs_total
        self.auto_reset, self.ignore_terminations = auto_reset, ignore_terminations
        self.group_size = group_size
        self.seed_fn = seed_fn or (lambda g, k: base_seed + g // group_size + k * (num_envs_total // group_size))
        self.episode_count = np.zeros(self.num_envs, np.int64) if episode_count is None \
            else np.asarray(episode_count, np.int64).copy()
        if self.episode_count.shape != (self.num_envs,):
            raise ValueError(f"episode_count has shape {self.episode_count.shape}, expected ({self.num_envs},)")
        B = self.num_envs
        self.obs = np.zeros((B, self.obs_dim), np.float32)
        self.image_shape = getattr(self.envs[0], "image_shape", None)
        self.rgb = np.zeros((B, *self.image_shape), np.uint8) if self.image_shape else None
        self.instruction = getattr(self.envs[0], "instruction", "")
        self.active = np.zeros(B, bool)
        self.seed = np.zeros(B, np.int64)
        self.ep_return = np.zeros(B, np.float64)
        self.ep_len = np.zeros(B, np.int64)
        self.success_once = np.zeros(B, bool)
        self.needs_reset = True

    # ----- episodes -----
    def _episode_id(self, b: int) -> int:
        return int((self.env_offset + b) + self.episode_count[b] * self.num_envs_total)

    def _reset_env(self, b: int) -> None:
        self.seed[b] = self.seed_fn(self.env_offset + b, int(self.episode_count[b]))
        self.obs[b] = self.envs[b].reset(int(self.seed[b]))
        if self.rgb is not None:
            self.rgb[b] = self.envs[b].render_rgb()
        self.active[b] = True
        self.ep_return[b], self.ep_len[b], self.success_once[b] = 0.0, 0, False

    def reset_all(self) -> np.ndarray:
        """Start a new episode in every env; return obs [B, O] float32."""
        for b in range(self.num_envs):
            self._reset_env(b)
        self.needs_reset = False
        return self.obs.copy()

    def current_obs(self) -> np.ndarray:
        """Observation the next chunk acts on, [B, O] float32 (resets all envs first if never reset)."""
        if self.needs_reset:
            self.reset_all()
        return self.obs.copy()

    def current_rgb(self) -> np.ndarray | None:
        """Camera image of `current_obs`, uint8 [B, H, W, 3], or None for envs without images."""
        if self.needs_reset:
            self.reset_all()
        return None if self.rgb is None else self.rgb.copy()

    def current_episodes(self) -> tuple[np.ndarray, np.ndarray]:
        """(episode_seed [B] int64, episode_id [B] int64) of the episodes the envs are in (-1 for idle envs)."""
        seed = np.where(self.active, self.seed, -1).astype(np.int64)
        ids = np.array([self._episode_id(b) if self.active[b] else -1 for b in range(self.num_envs)], np.int64)
        return seed, ids

    def state_dict(self) -> dict:
        """Cursor for resume: per-env count of episodes started before the current one."""
        return {"episode_count": self.episode_count.tolist()}

    # ----- stepping -----
    def _begin_chunk(self, actions: np.ndarray):
        """Check actions [B, C, D] (ValueError), reset if due, and return the chunk's buffers: clipped actions
        float32 [B, C, D] in [-1, 1], rewards [B, C], step_mask [B, C], terminated / truncated / success [B],
        final_obs [B, O] and final_rgb [B, H, W, 3] (None without images), zeroed."""
        B, D = self.num_envs, self.action_dim
        if actions.ndim != 3 or actions.shape[0] != B or actions.shape[2] != D:
            raise ValueError(f"actions must be [B={B}, C, D={D}], got {list(actions.shape)}")
        if self.needs_reset:
            self.reset_all()
        C = actions.shape[1]
        return (np.clip(actions, -1.0, 1.0).astype(np.float32), np.zeros((B, C), np.float32),
                np.zeros((B, C), bool), np.zeros(B, bool), np.zeros(B, bool), np.zeros(B, bool),
                np.zeros((B, self.obs_dim), np.float32), None if self.rgb is None else np.zeros_like(self.rgb))

    def chunk_step(self, actions: np.ndarray, render: bool = True) -> ChunkResult:
        """Execute an action chunk per env.

        Args:
            actions: float32 [B, C, D]; clipped to [-1, 1] before reaching the simulator.
            render: capture the images after the chunk (envs with images); False leaves `rgb` stale and
                `final_rgb` zero (recording several policy steps per stored chunk renders only the last).

        Raises:
            ValueError: actions of the wrong shape.
        """
        clipped, rewards, step_mask, terminated, truncated, success, final_obs, final_rgb = self._begin_chunk(actions)
        B, C = clipped.shape[:2]
        render = render and self.rgb is not None
        # idle envs (auto_reset=False, episode over) belong to no episode: -1
        episode_seed, episode_id = self.current_episodes()
        episodes = []
        for b in range(B):
            if not self.active[b]:
                continue
            env = self.envs[b]
            for c in range(C):
                obs, r, term, trunc, succ = env.step(clipped[b, c])
                if self.ignore_terminations:
                    term = False
                rewards[b, c] = r
                step_mask[b, c] = True
                self.obs[b] = obs
                self.ep_return[b] += r
                self.ep_len[b] += 1
                self.success_once[b] |= succ
                success[b] = succ
                if term or trunc:
                    terminated[b], truncated[b] = term, (trunc and not term)
                    break
            if terminated[b] or truncated[b]:
                final_obs[b] = self.obs[b]
                if render and truncated[b]:  # V(final_obs) bootstraps truncations only
                    final_rgb[b] = env.render_rgb()
                episodes.append({"env": self.env_offset + b, "seed": int(self.seed[b]), "episode_id": int(episode_id[b]),
                                 "return": float(self.ep_return[b]), "episode_len": int(self.ep_len[b]),
                                 "success_once": bool(self.success_once[b]), "success_at_end": bool(success[b])})
                self.episode_count[b] += 1
                if self.auto_reset:
                    self._reset_env(b)
                else:
                    self.active[b] = False
            elif render:
                self.rgb[b] = env.render_rgb()
        if not self.auto_reset and not self.active.any():
            self.needs_reset = True  # every env finished: the next chunk starts new episodes
        return ChunkResult(self.obs.copy(), rewards, terminated, truncated, step_mask, success, final_obs,
                           episode_seed, episode_id, episodes,
                           rgb=None if self.rgb is None else self.rgb.copy(), final_rgb=final_rgb)

    def close(self) -> None:
        for env in self.envs:
            env.close()
