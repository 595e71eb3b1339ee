"""EnvShard: a vectorised group of single-env simulator instances living in one worker process.

The shard is the ONE owner of the episode lifecycle: seeds, resets (at a rollout's start and automatic ones),
episode bookkeeping, action chunks, `auto_reset` and `ignore_terminations` (RLinf semantics), the `final_obs` of
truncated episodes, the `final_info` metrics of every finished episode (`success_once`, `success_at_end`,
`return`, `episode_len`), the per-shard torch RNG of the policy's exploration noise, and the cursor that resumes
all of it exactly. Rollout code calls `begin_rollout()` at a rollout's first chunk step, then `chunk_step()`,
and never resets anything itself.

Lifecycle modes (named after Gymnasium 1.x `AutoresetMode`; B envs, chunk steps of C actions):

| mode (`auto_reset`) | an episode ends at action c of chunk step t | next chunk step of that env | `begin_rollout()` |
|---|---|---|---|
| SAME_STEP (`true`) | actions c+1.. not executed (step_mask False); `final_obs` = its last obs; the env resets in the same chunk step: `obs` is the NEW episode's first obs | acts in the new episode (seed k+1) | first call ever: every env resets; later: nothing (open episodes continue across rollouts) |
| DISABLED (`false`) | same masking and `final_obs`; no reset: the env is idle until the rollout ends | idle: nothing executed, reward 0, step_mask False, episode_seed / episode_id -1, obs (and rgb) stay the final ones | every env starts a new episode; an episode still open (cut by the rollout's end) consumes its seed (episode_count += 1) and is NOT reported in `episodes` |

So without auto_reset every rollout holds exactly one episode per env, starting at its first chunk step: a chunk is
never executed in an episode other than the one whose observation it was chosen from, and the members of a GRPO
group (same episode_count) share every reset seed. `ignore_terminations` drops the simulator's `terminated`
(episodes end only by truncation); `terminated` and `truncated` are never both set.

Seeds: episode k of global env g gets reset seed `seed_fn(g, k)`; the default is `tasks.seeding.episode_seed`,
`base_seed + g // group_size + k * (num_envs_total // group_size)`, so every (env, episode) pair has a unique,
replayable seed (GRPO groups share theirs); its id is `tasks.seeding.episode_id`, `g + k * num_envs_total`.

Cursor (`state_dict()` -> `load_state_dict()`; lists, ints, floats and bools only, JSON- and pickle-friendly):
per env `episode_count`, the current (or, idle, the last) episode's `seed`, `active`, the clipped `actions` executed
in it so far, its `return` / `episode_len` / `success_once` accumulators; per shard (`parts`: one dict, one per stage
group after `join_cursors`) `started`, `chunk_steps` (the shard's life) and `rng` (the torch RNG state of its
policy calls, `policy_rng`, as lists of ints). Loading re-simulates every env's episode (reset(seed) + the same
actions; ManiSkill's CPU simulation is bit-identical for that, checked in tests/tasks/envs/test_lifecycle.py),
rendering only the final frame, so a shard built from a cursor continues EXACTLY (`is_cursor`: today's format; a
checkpoint holding the older `{"episode_count"}` one is refused on resume until `python -m pipelines.upgrade`
rewrites it). A simulator without that determinism
would silently continue from a drifted state: its shard must override `_restore_episodes`, as BatchedEnvShard
(GPU physics) does by restarting open episodes from their reset (same seeds; a warning names the envs).

Tasks and trials (multi-task simulators, LIBERO): after each reset the shard reads the env's `task_id` (an index
into the run's instruction table, `tasks.envs.instructions`; 0 for an env without the attribute, e.g. ManiSkill's
one task) and `trial_id` (the init state within that task; -1 without the attribute: ManiSkill's state comes from
the seed alone). `current_tasks()` gives both for the current observations (the prompt of the next chunk: an idle
env keeps its last episode's task_id, its trial_id is -1), `ChunkResult.task_id` those of `obs` after the chunk
(after an automatic reset: the new episode's), `ChunkResult.trial_id` the trial of the episode the chunk belonged
to, and every finished-episode record carries its `task_id` and `trial_id`.

GRPO scores each env's first episode of a rollout, so its configs must use DISABLED, or SAME_STEP with episodes
aligned to rollouts (tasks.config.check_grpo_episodes refuses the rest offline).

Action chunks (shape [B, C, D]): the C actions are executed in order. When an episode ends at action c < C-1
the remaining actions of that env are NOT executed (reward 0, `step_mask` False); the done flag is reported for
the chunk step. This differs from RLinf, which keeps stepping the finished env until the chunk ends; here the
post-episode actions never touch the simulator and are masked out of the loss.

Non-finite values: actions of active envs are checked before anything is stepped, observations (reset and step)
and rewards as the simulator returns them; the first one raises ValueError with one line naming the shard (its
global envs), the env (global index), the chunk step (within the rollout, and within the shard's life) and the
field (`actions` / `obs` / `rewards`).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from tasks.envs.rng import cuda_devices, get_rng, rng_from_lists, rng_to_lists
from tasks.seeding import episode_id, episode_seed, forked, seed_devices  # noqa: F401 (seed_devices re-exported)

# per-env cursor fields (lists of B) and per-shard ones (in `parts`)
CURSOR_ENV_FIELDS = ("episode_count", "seed", "active", "actions", "return", "episode_len", "success_once")
CURSOR_PART_FIELDS = ("started", "chunk_steps", "rng")


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
    # render_rgb() -> uint8 [H, W, 3] of the current state (K cameras: image_shape (K, H, W, 3), render_rgb()
    # [K, H, W, 3]; tasks.envs.num_cameras); instruction: str (the env task's prompt);
    # for videos (tasks.video): an instance made with render_size=S has render_frame() -> uint8 [S, S, 3]


@dataclass
class ChunkResult:
    """Outcome of one chunk step of a shard of B envs with chunks of C actions.

    obs [B, O] float32: observation after the chunk (after an automatic reset, if any; an idle env's final obs).
    rewards [B, C] float32: per-action rewards (0 for actions not executed).
    terminated [B] bool, truncated [B] bool: the episode ended within this chunk (kept apart; never both).
    step_mask [B, C] bool: which actions were executed.
    success [B] bool: the success flag after the last executed action.
    final_obs [B, O] float32: the episode's last observation where it ended (zeros elsewhere), for
        bootstrapping V(final_obs) on truncation.
    episode_seed [B] int64, episode_id [B] int64: the episode this chunk step belonged to (-1 for idle envs).
    trial_id [B] int64: the init-state index (within its task) of that episode (-1 for idle envs and simulators
        without trials).
    task_id [B] int64: the task of `obs` (the instruction-table index of the next chunk's prompt; module docstring).
    rgb [B, H, W, 3] uint8 or None: camera image of `obs` (envs with images only).
    final_rgb [B, H, W, 3] uint8 or None: image of `final_obs` where the episode was truncated (zeros elsewhere).
    episodes: one dict per episode that ended in this chunk step (terminated or truncated; episodes cut by a
        rollout's end are not listed): env, seed, episode_id, task_id, trial_id, return, episode_len, success_once,
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
    task_id: np.ndarray | None = None
    trial_id: np.ndarray | None = None


def is_cursor(cursor) -> bool:
    """Whether `cursor` is a shard cursor of today's format (`EnvShard.state_dict`): a dict with every per-env
    field (CURSOR_ENV_FIELDS) and a non-empty `parts` list of dicts with CURSOR_PART_FIELDS."""
    parts = cursor.get("parts") if isinstance(cursor, dict) else None
    return (isinstance(parts, list) and bool(parts) and all(f in cursor for f in CURSOR_ENV_FIELDS)
            and all(isinstance(p, dict) and all(f in p for f in CURSOR_PART_FIELDS) for p in parts))


def join_cursors(cursors: Sequence[dict]) -> dict:
    """One shard's cursor from its stage groups' cursors (in env order): per-env lists concatenated, `parts`
    listed."""
    out = {f: [v for c in cursors for v in c[f]] for f in CURSOR_ENV_FIELDS}
    out["parts"] = [p for c in cursors for p in c["parts"]]
    return out


def split_cursor(cursor: dict | None, num_parts: int, part: int) -> dict | None:
    """Stage group `part`'s cursor of a shard cursor split into `num_parts` equal env groups (inverse of
    `join_cursors`); a cursor of another number of parts keeps the envs' state and drops the per-part RNG."""
    if cursor is None or num_parts == 1:
        return cursor
    n = len(cursor["episode_count"]) // num_parts
    out = {f: list(cursor[f][part * n:(part + 1) * n]) for f in CURSOR_ENV_FIELDS if f in cursor}
    if "parts" in cursor:
        parts = cursor["parts"]
        out["parts"] = [parts[part] if len(parts) == num_parts else {**parts[0], "rng": None}]
    return out


class EnvShard:
    """B single envs stepped together with chunked actions; the episode lifecycle (module docstring).

    Args:
        envs: the simulator instances (same env task).
        env_offset: global index of envs[0] among all envs of the run (for seeds and episode ids).
        num_envs_total: number of envs in the run (seed stride).
        base_seed: see module docstring.
        auto_reset: lifecycle mode SAME_STEP (True) or DISABLED (False), see the module docstring.
        ignore_terminations: ignore the simulator's `terminated`; episodes end only by truncation (time limit).
        episode_count: per-env count of episodes started before the next one (a cursor's); zeros by default.
            A full cursor is loaded with `load_state_dict`.
        seed_fn: overrides the seed rule, (global_env, k) -> seed.
        group_size: envs per GRPO group: the `group_size` consecutive envs of a group share every reset seed,
            `base_seed + g // group_size + k * (num_envs_total // group_size)` (so the same initial state);
            1 = every env its own seed. A group must not straddle shards (ValueError).

    Images: envs with `image_shape` are rendered once per chunk step (after the chunk and after resets; an env
    whose episode ended without an automatic reset, at its end), not per simulator step; `rgb` [B, H, W, 3] uint8
    is the image of `obs`.
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
        self.seed_fn = seed_fn or (lambda g, k: episode_seed(base_seed, g, k, num_envs_total, group_size))
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
        self.task_id = np.zeros(B, np.int64)  # task of each env's current (idle: last) episode
        self.trial_id = np.full(B, -1, np.int64)  # its init-state index within the task (-1: none)
        self.ep_actions: list[list[np.ndarray]] = [[] for _ in range(B)]  # clipped actions of each env's episode
        self.needs_reset = True  # never started: the first begin_rollout / chunk_step / current_obs resets all
        self.chunk_steps = 0  # chunk steps over the shard's life (restored by load_state_dict)
        self.rollout_step = 0  # chunk steps since the last begin_rollout
        self.rng_state: dict | None = None  # torch RNG state of the policy calls (policy_rng); None: the global one
        self.rng_fresh = False  # seeded by seed_rng and not drawn from yet

    # ----- episodes -----
    def _episode_id(self, b: int) -> int:
        return episode_id(self.env_offset + b, int(self.episode_count[b]), self.num_envs_total)

    def _where(self, b: int, field_: str) -> str:
        """One line naming shard, env, chunk step and field (non-finite value errors)."""
        o = self.env_offset
        return (f"env shard of global envs {o}..{o + self.num_envs - 1}, env {o + b}, chunk step "
                f"{self.rollout_step} of the rollout ({self.chunk_steps} of the shard's life), field {field_}")

    def _check_finite(self, x, b: int, field_: str) -> None:
        if not np.all(np.isfinite(x)):
            raise ValueError(f"non-finite {field_} from the simulator: {self._where(b, field_)}")

    def _note_task(self, b: int, env=None) -> None:
        """Read env b's task_id / trial_id after its reset (0 / -1 for an env without them)."""
        env = self.envs[b] if env is None else env
        t, k = getattr(env, "task_id", None), getattr(env, "trial_id", None)
        self.task_id[b] = 0 if t is None else int(t)
        self.trial_id[b] = -1 if k is None else int(k)

    def _start_episode(self, b: int) -> None:
        """Bookkeeping of a new episode in env b (seed set, obs stored by the caller)."""
        self.active[b] = True
        self.ep_return[b], self.ep_len[b], self.success_once[b] = 0.0, 0, False
        self.ep_actions[b] = []

    def _reset_env(self, b: int) -> None:
        self.seed[b] = self.seed_fn(self.env_offset + b, int(self.episode_count[b]))
        obs = self.envs[b].reset(int(self.seed[b]))
        self._check_finite(obs, b, "obs")
        self._note_task(b)
        self.obs[b] = obs
        if self.rgb is not None:
            self.rgb[b] = self.envs[b].render_rgb()
        self._start_episode(b)

    def reset_all(self) -> np.ndarray:
        """Start episode `episode_count[b]` in every env (open episodes are restarted, not counted); return obs
        [B, O] float32. A low-level call: rollouts use `begin_rollout`."""
        for b in range(self.num_envs):
            self._reset_env(b)
        self.needs_reset = False
        return self.obs.copy()

    def begin_rollout(self) -> None:
        """Start a rollout (call before its first chunk step; see the module's lifecycle table).

        First call ever (or after `load_state_dict` of a never-started cursor): every env starts episode
        `episode_count`. Later, SAME_STEP (auto_reset): nothing, open episodes continue. DISABLED: every open
        episode is cut (its seed consumed, episode_count += 1, not reported), then every env starts a new episode.
        """
        if not self.needs_reset and not self.auto_reset:
            self.episode_count[self.active] += 1  # cut episodes consume their seeds
            self.needs_reset = True
        if self.needs_reset:
            self.reset_all()
        self.rollout_step = 0

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

    def current_tasks(self) -> tuple[np.ndarray, np.ndarray]:
        """(task_id [B] int64, trial_id [B] int64) of the current observations (module docstring: an idle env
        keeps its last task_id, its trial_id is -1)."""
        if self.needs_reset:
            self.reset_all()
        return self.task_id.copy(), np.where(self.active, self.trial_id, -1).astype(np.int64)

    def current_episodes(self) -> tuple[np.ndarray, np.ndarray]:
        """(episode_seed [B] int64, episode_id [B] int64) of the episodes the envs are in (-1 for idle envs)."""
        seed = np.where(self.active, self.seed, -1).astype(np.int64)
        ids = np.array([self._episode_id(b) if self.active[b] else -1 for b in range(self.num_envs)], np.int64)
        return seed, ids

    # ----- cursor -----
    def state_dict(self) -> dict:
        """The cursor (module docstring): everything needed to continue exactly; plain lists/ints/floats/bools.
        A copy: later steps do not change it."""
        return {
            "episode_count": self.episode_count.tolist(),
            "seed": self.seed.tolist(),
            "active": self.active.tolist(),
            "actions": [np.asarray(a, np.float32).reshape(-1, self.action_dim).tolist() for a in self.ep_actions],
            "return": self.ep_return.tolist(),
            "episode_len": self.ep_len.tolist(),
            "success_once": self.success_once.tolist(),
            "parts": [{"started": not self.needs_reset, "chunk_steps": int(self.chunk_steps),
                       "rng": rng_to_lists(self.rng_state)}],
        }

    def load_state_dict(self, cursor: dict | None) -> None:
        """Continue from a cursor (`state_dict` of a shard of the same envs): every env's episode is re-simulated
        (reset(seed) + its actions; the final frame rendered), accumulators and RNG state restored; one whose shard
        had not started (`started` False) starts fresh episodes at its counts at the next begin_rollout. None: a
        fresh shard (counts 0). Raises ValueError for a cursor not of today's format (`is_cursor`), of another
        number of envs or action dim."""
        if cursor is None:
            self.episode_count = np.zeros(self.num_envs, np.int64)
            self.active[:] = False
            self.chunk_steps, self.rollout_step, self.needs_reset = 0, 0, True
            return
        if not is_cursor(cursor):
            raise ValueError(f"not an env shard cursor of today's format (keys {sorted(cursor)}): a checkpoint of an "
                             f"older format; rewrite its run once with `python -m pipelines.upgrade RUN_DIR`")
        counts = np.asarray(cursor["episode_count"], np.int64)
        if counts.shape != (self.num_envs,):
            raise ValueError(f"cursor has {counts.shape} episode counts, the shard {self.num_envs} envs")
        self.episode_count = counts.copy()
        self.active[:] = False
        part = cursor["parts"][0]
        self.chunk_steps = int(part["chunk_steps"])
        self.rollout_step = 0
        if part["rng"] is not None:
            self.rng_state, self.rng_fresh = rng_from_lists(part["rng"]), False
        if not part["started"]:
            self.needs_reset = True
            return
        self.seed[:] = cursor["seed"]
        actions = [np.asarray(a, np.float32).reshape(-1, self.action_dim) for a in cursor["actions"]]
        self._restore_episodes(actions)
        self.active[:] = cursor["active"]
        self.ep_return[:] = cursor["return"]
        self.ep_len[:] = cursor["episode_len"]
        self.success_once[:] = cursor["success_once"]
        self.needs_reset = False

    def _restore_episodes(self, actions: list[np.ndarray]) -> None:
        """Re-simulate every env's episode: reset(seed) + the actions (clipped float32 [n_b, D]) -> obs, rgb."""
        for b, acts in enumerate(actions):
            env = self.envs[b]
            obs = env.reset(int(self.seed[b]))
            self._note_task(b)
            for a in acts:
                obs = env.step(a)[0]
            self.obs[b] = obs
            if self.rgb is not None:
                self.rgb[b] = env.render_rgb()
            self.ep_actions[b] = list(acts)

    # ----- the policy's RNG -----
    def rng_key(self) -> list[int]:
        """[first global env, chunk steps of the shard's life]: identifies the shard's next chunk step across
        resumes (disaggregated inference seeds its draw from the keys of its shards)."""
        return [int(self.env_offset), int(self.chunk_steps)]

    def seed_rng(self, seed: int, device=None) -> None:
        """Set the shard's policy RNG to torch.manual_seed(seed)'s state (CPU, and `device` if CUDA)."""
        devs = cuda_devices(device)
        with forked(seed, devs):
            self.rng_state = get_rng(devs)
        self.rng_fresh = True

    @contextmanager
    def policy_rng(self, device=None):
        """Run the block (policy calls) on this shard's own torch RNG stream: the global RNG is forked, set to
        the shard's state, and the state after the block is kept for the next call (and the cursor), so shards
        sharing a worker never share draws. With no state yet the block continues the global stream."""
        import torch
        devs = cuda_devices(device)
        with torch.random.fork_rng(devices=devs):
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state["cpu"])
                for d, st in zip(devs, self.rng_state.get("cuda") or []):
                    torch.cuda.set_rng_state(st, d)
            try:
                yield
            finally:
                self.rng_state, self.rng_fresh = get_rng(devs), False

    # ----- stepping -----
    def _begin_chunk(self, actions: np.ndarray):
        """Check actions [B, C, D] (ValueError: shape; non-finite in an active env), reset if never started, and
        return the chunk's buffers: clipped actions float32 [B, C, D] in [-1, 1], rewards [B, C], step_mask
        [B, C], terminated / truncated / success [B], final_obs [B, O] and final_rgb [B, H, W, 3] (None without
        images), zeroed."""
        B, D = self.num_envs, self.action_dim
        actions = np.asarray(actions)
        if actions.ndim != 3 or actions.shape[0] != B or actions.shape[2] != D:
            raise ValueError(f"actions must be [B={B}, C, D={D}], got {list(actions.shape)}")
        if self.needs_reset:
            self.reset_all()
        bad = ~np.isfinite(actions).all(axis=(1, 2)) & self.active
        if bad.any():
            raise ValueError(f"non-finite actions before stepping: {self._where(int(np.flatnonzero(bad)[0]), 'actions')}")
        C = actions.shape[1]
        return (np.clip(actions, -1.0, 1.0).astype(np.float32), np.zeros((B, C), np.float32),
                np.zeros((B, C), bool), np.zeros(B, bool), np.zeros(B, bool), np.zeros(B, bool),
                np.zeros((B, self.obs_dim), np.float32), None if self.rgb is None else np.zeros_like(self.rgb))

    def _end_chunk(self) -> None:
        self.chunk_steps += 1
        self.rollout_step += 1

    def _episode_record(self, b: int, episode_id: int, success_at_end: bool) -> dict:
        return {"env": self.env_offset + int(b), "seed": int(self.seed[b]), "episode_id": int(episode_id),
                "task_id": int(self.task_id[b]), "trial_id": int(self.trial_id[b]),
                "return": float(self.ep_return[b]), "episode_len": int(self.ep_len[b]),
                "success_once": bool(self.success_once[b]), "success_at_end": bool(success_at_end)}

    def chunk_step(self, actions: np.ndarray, render: bool = True) -> ChunkResult:
        """Execute an action chunk per env (lifecycle: module docstring).

        Args:
            actions: float32 [B, C, D]; clipped to [-1, 1] before reaching the simulator.
            render: capture the images after the chunk (envs with images); False leaves `rgb` stale and
                `final_rgb` zero (recording several policy steps per stored chunk renders only the last).

        Raises:
            ValueError: actions of the wrong shape; a non-finite action of an active env (before anything is
                stepped), or a non-finite observation or reward from the simulator (one line: shard, env, chunk
                step, field).
        """
        clipped, rewards, step_mask, terminated, truncated, success, final_obs, final_rgb = self._begin_chunk(actions)
        B, C = clipped.shape[:2]
        render = render and self.rgb is not None
        # idle envs (auto_reset=False, episode over) belong to no episode: -1
        episode_seed, episode_id = self.current_episodes()
        trial_id = self.current_tasks()[1]
        episodes = []
        for b in range(B):
            if not self.active[b]:
                continue
            env = self.envs[b]
            for c in range(C):
                obs, r, term, trunc, succ = env.step(clipped[b, c])
                self._check_finite(obs, b, "obs")
                self._check_finite(r, b, "rewards")
                self.ep_actions[b].append(clipped[b, c])
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
                if render and (truncated[b] or not self.auto_reset):  # V(final_obs) bootstraps truncations only
                    img = env.render_rgb()
                    if truncated[b]:
                        final_rgb[b] = img
                    if not self.auto_reset:
                        self.rgb[b] = img  # an idle env shows its final state
                episodes.append(self._episode_record(b, episode_id[b], success[b]))
                self.episode_count[b] += 1
                if self.auto_reset:
                    self._reset_env(b)
                else:
                    self.active[b] = False
            elif render:
                self.rgb[b] = env.render_rgb()
        self._end_chunk()
        return ChunkResult(self.obs.copy(), rewards, terminated, truncated, step_mask, success, final_obs,
                           episode_seed, episode_id, episodes,
                           rgb=None if self.rgb is None else self.rgb.copy(), final_rgb=final_rgb,
                           task_id=self.task_id.copy(), trial_id=trial_id)

    def close(self) -> None:
        for env in self.envs:
            env.close()
