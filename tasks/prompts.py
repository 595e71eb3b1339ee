"""Prompts: the run's instruction table and the policy's observation dict.

Policies see observations as a dict of tensors ({"state", "rgb", "prompt"}, see tasks.policies); `policy_obs`
builds it. Prompts are per env: the run's instruction table (`instructions(cfg)`: the simulator's tasks in order,
one string for ManiSkill) indexed by each observation's `task_id` (the shard's `current_tasks`; the stored
`task_id` field), so one batch may hold several tasks; the table is tokenised once per policy instance. Rollouts
(tasks.rollout), the update (tasks.actor.loop) and SFT (tasks.demos) build their observations here.
"""
from __future__ import annotations

import torch

from tasks.config import Config


def prompt_tokens(policy: torch.nn.Module, prompts, task_id=None, batch: int | None = None):
    """int64 [B, L] prompt tokens for a VLA (None for policies without prompts).

    Args:
        prompts: the instruction table (a sequence of strings indexed by task id), or one string for every sample.
        task_id: int [B] (numpy or torch) indices into `prompts`; None: task 0 for `batch` samples.
    The table is tokenised once per policy instance (cached on it: rollouts and updates call this at every chunk
    step or minibatch); a batch is the table's rows at `task_id`. Raises IndexError for a task id outside the table.
    """
    if not getattr(policy, "needs_prompt", False):
        return None
    table = (prompts,) if isinstance(prompts, str) else tuple(prompts)
    cache = policy.__dict__.setdefault("_prompt_cache", {})
    if table not in cache:
        cache[table] = policy.tokenize(list(table))
    tokens = cache[table]
    idx = torch.zeros(int(batch), dtype=torch.long) if task_id is None else torch.as_tensor(task_id).long().cpu()
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(table)):
        raise IndexError(f"task ids {sorted(set(idx.tolist()))} outside the instruction table of {len(table)} "
                         f"(tasks.envs.instructions)")
    return tokens[idx]


CAMERA_KEYS = ("rgb", "wrist_rgb")  # the policy's obs keys of an env's cameras, in the env's camera order


def policy_obs(policy: torch.nn.Module, state, rgb, prompts, task_id=None) -> dict[str, torch.Tensor]:
    """The policy's observation dict from arrays or tensors: state f32 [B, O], rgb u8 [B, H, W, 3] (one camera)
    or [B, K, H, W, 3] (K cameras: LIBERO's env.wrist_camera; camera k becomes obs[CAMERA_KEYS[k]], each
    [B, H, W, 3]) or None; prompts: the instruction table (or one string), task_id int [B] into it (None: 0 for
    every sample).

    Raises ValueError for more cameras than CAMERA_KEYS names."""
    obs = {"state": torch.as_tensor(state)}
    if rgb is not None:
        rgb = torch.as_tensor(rgb)
        if rgb.dim() == 5:  # [B, K, H, W, 3] -> K x [B, H, W, 3]
            if rgb.shape[1] > len(CAMERA_KEYS):
                raise ValueError(f"{rgb.shape[1]} cameras per observation; the policies' obs name "
                                 f"{len(CAMERA_KEYS)} ({list(CAMERA_KEYS)})")
            obs.update({CAMERA_KEYS[k]: rgb[:, k] for k in range(rgb.shape[1])})
        else:
            obs["rgb"] = rgb
    tok = prompt_tokens(policy, prompts, task_id, len(state))
    if tok is not None:
        obs["prompt"] = tok
    return obs


def instruction(cfg: Config) -> str:
    """The env task's natural-language instruction (the VLA prompt), by the simulator's adapter (with several
    tasks: the first selected one's; per-env prompts use `instructions`)."""
    from tasks.envs import instruction as env_instruction
    return env_instruction(cfg.env)


def instructions(cfg: Config) -> tuple[str, ...]:
    """The run's instruction table (tasks.envs.instructions: index = task_id), cached per process (a plain dict
    keyed by the env section, whose family decides what the table depends on (LIBERO: the suite and
    env.instruction_source), not the worker's resident registry: the table is no per-run state)."""
    key = repr(cfg.env)
    if key not in _INSTRUCTIONS:
        from tasks.envs import instructions as env_instructions
        _INSTRUCTIONS[key] = tuple(env_instructions(cfg.env))
    return _INSTRUCTIONS[key]


_INSTRUCTIONS: dict[str, tuple[str, ...]] = {}
