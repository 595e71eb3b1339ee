"""Scripted teachers (`record.teacher=scripted:NAME`): experts that act from the simulator's state, one per
shard, for recording demos (pipelines.record). A teacher is one line of SCRIPTED_TEACHERS."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.config import ConfigError

if TYPE_CHECKING:
    from tasks.config import EnvConfig
    from tasks.envs.shard import EnvShard

SCRIPTED_PREFIX = "scripted:"
# `record.teacher=scripted:NAME`: NAME -> (the simulator it drives, module, class of its per-shard teacher)
SCRIPTED_TEACHERS: dict[str, tuple[str, str, str]] = {"libero": ("libero", "tasks.envs.libero.expert", "ShardExpert")}


def is_scripted_teacher(spec) -> bool:
    """Whether a `record.teacher` value names a scripted expert (`scripted:NAME`) rather than a trained run."""
    return isinstance(spec, str) and spec.startswith(SCRIPTED_PREFIX)


def check_scripted_teacher(spec: str, cfg: EnvConfig) -> None:
    """Offline checks of `record.teacher=scripted:NAME` against cfg's env: a known NAME, its simulator, and the
    expert's own task checks (its module's `check_tasks(cfg)`). Raises ConfigError (record.teacher / env.*)."""
    import importlib
    name = spec[len(SCRIPTED_PREFIX):]
    if name not in SCRIPTED_TEACHERS:
        raise ConfigError("record.teacher", spec, f"no scripted expert {name!r}; known: "
                                                  f"{[SCRIPTED_PREFIX + k for k in SCRIPTED_TEACHERS]}, or a run "
                                                  f"directory / run id of a trained teacher")
    sim, module, _ = SCRIPTED_TEACHERS[name]
    if cfg.simulator != sim:
        raise ConfigError("record.teacher", spec, f"drives env.simulator={sim}, this env is {cfg.simulator}: "
                                                  f"use an env={sim}_* conf or a trained teacher run")
    importlib.import_module(module).check_tasks(cfg)


def make_scripted_teacher(spec: str, shard: EnvShard, action_noise: float = 0.0):
    """The per-shard scripted teacher of `record.teacher=scripted:NAME` (`act(shard)` -> float32 [B, 1, D]);
    `action_noise`: record.action_noise."""
    import importlib
    _, module, cls = SCRIPTED_TEACHERS[spec[len(SCRIPTED_PREFIX):]]
    return getattr(importlib.import_module(module), cls)(shard, action_noise=action_noise)
