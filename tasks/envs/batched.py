"""BatchedEnvShard: an EnvShard over ONE simulator instance that holds all B envs (GPU simulation, e.g. ManiSkill's
`physx_cuda`: one process steps thousands of envs as batched tensors).

Same semantics as `EnvShard` (the lifecycle table of tasks.envs.shard: seeds, episode ids and cursors, action
chunks, auto_reset, ignore_terminations, `begin_rollout`, episode metrics, non-finite checks, the policy RNG; the
ChunkResult layout), computed with array operations: a chunk of C actions is C batched simulator steps. The
differences a batched simulator forces:

* every env is stepped at every simulator step. An env whose episode ended earlier in the chunk (or an idle env
  without auto_reset) receives zero actions and its results are discarded (reward 0, `step_mask` False), exactly
  what EnvShard reports; its observation stays the episode's final one. Its image (final_rgb of a truncation, the
  idle image without auto_reset) is rendered before the next simulator step changes its state (at most one extra
  batched render per simulator step at which an episode ended mid-chunk), so images equal EnvShard's;
* GPU physics is not deterministic, so `load_state_dict` cannot re-simulate open episodes: it restores the
  counters, seeds and RNG state, and RESTARTS each env's episode from its reset (same seed and episode id,
  return / length / actions zeroed; an idle env is reset too and stays idle), with a warning when an episode had
  progressed. A resumed GPU run therefore continues the seed sequence but not the open episodes' states.
(tests/tasks/envs/test_batched.py checks a BatchedEnvShard against an EnvShard on the same fake dynamics.)
"""
from __future__ import annotations

import warnings
from typing import Callable, Protocol, Sequence

import numpy as np

from tasks.envs.shard import ChunkResult, EnvShard, is_cursor


class BatchedEnv(Protocol):
    """B envs in one simulator instance; numpy in, numpy out (adapters convert from device tensors)."""

    num_envs: int
    obs_dim: int
    action_dim: int

    def reset(self, seeds: np.ndarray, env_idx: np.ndarray) -> np.ndarray:
        """Reset envs `env_idx` (int [n]) with reset seeds `seeds` (int64 [n]); return their obs float32 [n, O]."""

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, ...]:
        """One step of every env with actions float32 [B, D] in [-1, 1]; return obs float32 [B, O], reward
        float32 [B], terminated bool [B], truncated bool [B], success bool [B]."""

    def close(self) -> None: ...

    # optional, for obs_mode=rgb: image_shape (H, W, 3) and render_rgb() -> uint8 [B, H, W, 3]; instruction: str


class _EnvView:
    """What EnvShard.__init__ reads from each env (dims, image shape, instruction) for env b of a batched one."""

    def __init__(self, env: BatchedEnv):
        self.obs_dim, self.action_dim = env.obs_dim, env.action_dim
        self.image_shape = getattr(env, "image_shape", None)
        self.instruction = getattr(env, "instruction", "")

    def close(self) -> None:
        pass


class BatchedEnvShard(EnvShard):
    """EnvShard over one BatchedEnv of B envs; constructor arguments as EnvShard's except `env`."""

    def __init__(self, env: BatchedEnv, *, env_offset: int, num_envs_total: int, base_seed: int, auto_reset: bool,
                 ignore_terminations: bool, episode_count: Sequence[int] | None = None,
                 seed_fn: Callable[[int, int], int] | None = None, group_size: int = 1):
        super().__init__([_EnvView(env)] * env.num_envs, env_offset=env_offset, num_envs_total=num_envs_total,
                         base_seed=base_seed, auto_reset=auto_reset, ignore_terminations=ignore_terminations,
                         episode_count=episode_count, seed_fn=seed_fn, group_size=group_size)
        self.env = env

    def _reset_envs(self, idx: np.ndarray, seeds: np.ndarray | None = None) -> None:
        """New episodes in envs `idx` (int [n]) with their next seeds (or `seeds`); refreshes their obs (and
        images)."""
        if len(idx) == 0:
            return
        for b in idx:
            self.seed[b] = self.seed_fn(self.env_offset + int(b), int(self.episode_count[b]))
        if seeds is not None:
            self.seed[idx] = seeds
        obs = self.env.reset(self.seed[idx].copy(), idx)
        for i, b in enumerate(idx):
            self._check_finite(obs[i], int(b), "obs")
        self.obs[idx] = obs
        if self.rgb is not None:
            self.rgb[idx] = self.env.render_rgb()[idx]
        for b in idx:
            self._note_task(int(b), self.envs[int(b)])
            self._start_episode(int(b))

    def _reset_env(self, b: int) -> None:
        self._reset_envs(np.array([b]))

    def reset_all(self) -> np.ndarray:
        self._reset_envs(np.arange(self.num_envs))
        self.needs_reset = False
        return self.obs.copy()

    def _restore_episodes(self, actions: list[np.ndarray]) -> None:
        """GPU physics is not deterministic: restart every env's episode from its reset (module docstring)."""
        self._reset_envs(np.arange(self.num_envs), self.seed.copy())

    def load_state_dict(self, cursor: dict | None) -> None:
        """EnvShard.load_state_dict, except that episodes restart from reset (accumulators zeroed; a warning
        names the envs whose episode had progressed). The batched shard keeps no action log (`actions` of its
        cursor are empty lists)."""
        started = cursor is not None and is_cursor(cursor) and cursor["parts"][0]["started"]  # else refused below
        progressed = [self.env_offset + b for b, n in enumerate(cursor["episode_len"]) if n] if started else []
        if progressed:
            warnings.warn(f"BatchedEnvShard: GPU simulation cannot re-simulate open episodes exactly; the episodes "
                          f"of global envs {progressed} restart from their reset (same seeds)", RuntimeWarning,
                          stacklevel=2)
        super().load_state_dict(cursor)
        if not self.needs_reset and cursor is not None:
            self.active[:] = cursor["active"]
            self.ep_return[:], self.ep_len[:], self.success_once[:] = 0.0, 0, False

    def chunk_step(self, actions: np.ndarray, render: bool = True) -> ChunkResult:
        """EnvShard.chunk_step with C batched simulator steps (see the module docstring)."""
        clipped, rewards, step_mask, terminated, truncated, success, final_obs, final_rgb = self._begin_chunk(actions)
        B, C = clipped.shape[:2]
        render = render and self.rgb is not None
        episode_seed, episode_id = self.current_episodes()
        trial_id = self.current_tasks()[1]
        live = self.active.copy()  # envs still executing actions in this chunk
        end_img = np.zeros(B, bool)  # ended envs whose final image is still to be captured
        imgs_at_end = None if self.rgb is None else np.zeros_like(self.rgb)
        for c in range(C):
            if not live.any():
                break
            if render and end_img.any():  # capture them before this step moves their (discarded) state
                imgs = self.env.render_rgb()
                imgs_at_end[end_img] = imgs[end_img]
                end_img[:] = False
            obs, r, term, trunc, succ = self.env.step(np.where(live[:, None], clipped[:, c], 0.0).astype(np.float32))
            term = np.zeros(B, bool) if self.ignore_terminations else np.asarray(term, bool)
            trunc, succ, r = np.asarray(trunc, bool), np.asarray(succ, bool), np.asarray(r, np.float64)
            for name, bad in (("obs", ~np.isfinite(obs).all(axis=1)), ("rewards", ~np.isfinite(r))):
                if (bad & live).any():
                    b = int(np.flatnonzero(bad & live)[0])
                    raise ValueError(f"non-finite {name} from the simulator: {self._where(b, name)}")
            rewards[live, c] = r[live]
            step_mask[live, c] = True
            self.obs[live] = obs[live]
            self.ep_return[live] += r[live]
            self.ep_len[live] += 1
            self.success_once[live] |= succ[live]
            success[live] = succ[live]
            ended = live & (term | trunc)
            terminated[ended] = term[ended]
            truncated[ended] = trunc[ended] & ~term[ended]
            end_img |= ended & (truncated | (not self.auto_reset))
            live &= ~ended
        done = terminated | truncated
        if render:
            imgs = self.env.render_rgb()  # [B, H, W, 3] of the state after the chunk
            imgs_at_end[end_img] = imgs[end_img]
            final_rgb[truncated] = imgs_at_end[truncated]  # V(final_obs) bootstraps truncations only
            keep = self.active & ~done
            self.rgb[keep] = imgs[keep]
            if not self.auto_reset:
                self.rgb[done] = imgs_at_end[done]  # an idle env shows its final state
        episodes = []
        for b in np.flatnonzero(done):
            final_obs[b] = self.obs[b]
            episodes.append(self._episode_record(b, episode_id[b], success[b]))
        self.episode_count[done] += 1
        if self.auto_reset:
            self._reset_envs(np.flatnonzero(done))
        else:
            self.active[done] = False
        self._end_chunk()
        return ChunkResult(self.obs.copy(), rewards, terminated, truncated, step_mask, success, final_obs,
                           episode_seed, episode_id, episodes,
                           rgb=None if self.rgb is None else self.rgb.copy(), final_rgb=final_rgb,
                           task_id=self.task_id.copy(), trial_id=trial_id)

    def close(self) -> None:
        self.env.close()
