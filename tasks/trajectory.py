"""The trajectory schema: every field a rollout produces, declared once.

A trajectory is one env shard's rollout of one training step, a dict of numpy arrays travelling between graph
nodes. Its `[T, B, ...]` fields (T chunk steps, B envs of the shard) and its once-per-rollout fields are the
`Field`s of `FIELDS`; what each consumer uses is a view of that one list:

  - the rollout (`tasks.rollout`) assembles and concatenates the step fields (`is_step_field`, `STEP_FIELDS`),
    taking `POLICY_OUTPUTS` from inference and `ENV_OUTPUTS` from the env's chunk step;
  - the zarr store of a training run holds the `stored` fields (`zarr_schema`; `graphs._store` writes exactly
    them); a demonstration store (`pipelines.record`) the `recorded` ones (`record_schema`);
  - the update flattens the `update` fields (`SAMPLE_FIELDS`, `is_sample_field`); `advantages` passes the
    rollout's ones through (`PASSTHROUGH`) and adds its own (source "advantages");
  - replay refuses a store without the `replay` fields (`REPLAY_FIELDS`);
  - the README's "Trajectory fields" table is `markdown()` (`python -m tasks.trajectory --markdown`; a test keeps
    the two equal).

Besides arrays a trajectory carries a few bookkeeping entries, named by the `Meta` constants (`META` describes
them): finished episodes, the shard's cursor, timings, the acting weight version, weight-sync and offload costs.
`EXTRAS_PREFIX` names the policy's own per-step tensors (`extras/<name>`, e.g. a flow VLA's denoising chain), which
the update needs to recompute log-probs and which are never stored.

Shapes are the per-sample trailing dims after `[T, B]` (`[B]` for once-per-rollout fields), a function of `Dims`:
O obs dim, D action dim, C actions per chunk, V value outputs (C with action-level rewards, else 1), H image size.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SOURCES = ("observation", "policy", "critic", "env", "advantages")


@dataclass(frozen=True)
class Dims:
    """The config dimensions field shapes depend on (`from_config` derives them)."""

    obs_dim: int  # O
    action_dim: int  # D
    num_action_chunks: int  # C
    num_values: int  # V: C for action-level rewards, else 1
    image_size: int | None  # H (= W) with obs_mode=rgb; None: no rgb field
    action_level: bool = False  # reward_type=action_level: advantages / returns per action
    num_cameras: int = 1  # K camera images per observation (tasks.envs.num_cameras); K > 1: rgb is [K, H, H, 3]

    @classmethod
    def from_config(cls, cfg, obs_dim: int, action_dim: int) -> Dims:
        """Dims of a config (`tasks.config.Config`) and its env task's (obs_dim, action_dim)."""
        from tasks.envs import num_cameras as env_num_cameras
        return cls(obs_dim=int(obs_dim), action_dim=int(action_dim), num_action_chunks=cfg.policy.num_action_chunks,
                   num_values=num_values(cfg), image_size=cfg.env.image_size if cfg.env.obs_mode == "rgb" else None,
                   action_level=cfg.algorithm.reward_type == "action_level",
                   num_cameras=max(env_num_cameras(cfg.env), 1))


def num_values(cfg) -> int:
    """Value outputs per chunk step V: C (`policy.num_action_chunks`) for action-level rewards, else 1."""
    return cfg.policy.num_action_chunks if cfg.algorithm.reward_type == "action_level" else 1


@dataclass(frozen=True)
class Field:
    """One trajectory field.

    Attributes:
        name: the key in the trajectory dict and the zarr array name.
        dims: the trailing shape in symbols, as the README shows it ("C, D"; "" for one value per sample).
        shape: the trailing shape as ints from `Dims` (None: the field is absent under these dims).
        dtype: numpy dtype name (float32 | bool | int64 | uint8).
        source: who produces it: observation | policy | critic | env | advantages (see SOURCES).
        meaning: what it holds, with units.
        stored: a zarr array of a training run's trajectory store.
        update: in the update's flattened samples.
        replay: read by pipelines.replay (a store without it cannot be replayed).
        recorded: in a demonstration store written by pipelines.record.
        per_step: `[T, B, ...]` (False: `[B, ...]`, once per rollout).
        when: the config condition under which it exists ("" = always).
    """

    name: str
    dims: str
    shape: Callable[[Dims], tuple[int, ...] | None]
    dtype: str
    source: str
    meaning: str
    stored: bool
    update: bool
    replay: bool = False
    recorded: bool = False
    per_step: bool = True
    when: str = ""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"Field {self.name!r}: source {self.source!r} is not one of {SOURCES}")


def _scalar(d: Dims) -> tuple[int, ...]:
    return ()


def _image_shape(d: Dims) -> tuple[int, ...] | None:
    """(H, H, 3) with one camera, (K, H, H, 3) with K > 1, None without images."""
    if d.image_size is None:
        return None
    one = (d.image_size, d.image_size, 3)
    return (d.num_cameras, *one) if d.num_cameras > 1 else one


FIELDS: tuple[Field, ...] = (
    Field("obs", "O", lambda d: (d.obs_dim,), "float32", "observation",
          "observation the chunk was chosen from (state vector)", stored=True, update=True, replay=True,
          recorded=True),
    Field("rgb", "[K,] H, H, 3", _image_shape, "uint8", "observation",
          "camera image of the same observation (pixels, 0-255); with K > 1 cameras (LIBERO's env.wrist_camera) "
          "[K, H, H, 3], cameras in the order of tasks.prompts.CAMERA_KEYS", stored=True, update=True,
          recorded=True, when="env.obs_mode=rgb"),
    Field("task_id", "", _scalar, "int64", "observation",
          "task of the observation: its index in the run's instruction table (`tasks.envs.instructions`; the "
          "prompt the policy saw; LIBERO: the suite's task id, ManiSkill: 0)", stored=True, update=True,
          recorded=True),
    Field("actions", "C, D", lambda d: (d.num_action_chunks, d.action_dim), "float32", "policy",
          "sampled actions, **unclipped** (the env received `clip(a, -1, 1)`)", stored=True, update=True, replay=True,
          recorded=True),
    Field("logprobs", "C, D", lambda d: (d.num_action_chunks, d.action_dim), "float32", "policy",
          "behaviour log-probs per action dimension (nats)", stored=True, update=True),
    Field("values", "V", lambda d: (d.num_values,), "float32", "policy",
          "critic value V(obs) (return units; per action with action-level rewards)", stored=True, update=True),
    Field("final_values", "V", lambda d: (d.num_values,), "float32", "critic",
          "V(final_obs) where the episode was truncated in this chunk, else 0", stored=True, update=False),
    Field("rewards", "C", lambda d: (d.num_action_chunks,), "float32", "env",
          "reward of each action of the chunk (env reward units; 0 where not executed)", stored=True, update=False,
          replay=True, recorded=True),
    Field("terminated", "", _scalar, "bool", "env",
          "the episode reached a terminal state in this chunk (no bootstrap; never with truncated)", stored=True,
          update=False, replay=True, recorded=True),
    Field("truncated", "", _scalar, "bool", "env",
          "the episode hit its time limit in this chunk (bootstraps from final_values)", stored=True,
          update=False, replay=True, recorded=True),
    Field("step_mask", "C", lambda d: (d.num_action_chunks,), "bool", "env",
          "the actions of the chunk that were executed (False after an episode ended, or for an idle env)",
          stored=True, update=True, replay=True, recorded=True),
    Field("success", "", _scalar, "bool", "env", "the task's success flag after the chunk's last executed action",
          stored=True, update=False, replay=True, recorded=True),
    Field("episode_seed", "", _scalar, "int64", "env",
          "reset seed of the episode the chunk belongs to (-1 for an idle env; tasks.seeding)", stored=True,
          update=False, replay=True, recorded=True),
    Field("trial_id", "", _scalar, "int64", "env",
          "init-state index within its task of the episode the chunk belongs to (LIBERO; -1 for ManiSkill, whose "
          "initial state is the seed's, and for an idle env)", stored=True, update=False, recorded=True),
    Field("episode_id", "", _scalar, "int64", "env",
          "id of the episode the chunk belongs to, unique in the run (-1 for an idle env)", stored=True, update=False,
          replay=True, recorded=True),
    Field("bootstrap_values", "V", lambda d: (d.num_values,), "float32", "critic",
          "V of the observation after the last chunk step", stored=False, update=False, per_step=False),
    Field("advantages", "(C)", lambda d: (d.num_action_chunks,) if d.action_level else (), "float32", "advantages",
          "GAE or GRPO advantage (per action with action-level rewards)", stored=False, update=True),
    Field("returns", "(C)", lambda d: (d.num_action_chunks,) if d.action_level else (), "float32", "advantages",
          "value targets (return units; per action with action-level rewards)", stored=False, update=True),
    Field("loss_mask", "", _scalar, "bool", "advantages",
          "the chunk steps that enter the loss (an executed action, a finite input)", stored=False, update=True),
)
BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}

EXTRAS_PREFIX = "extras/"  # extras/<name> [T, B, ...]: the policy's own tensors (tasks.policies `act()["extras"]`)


class Meta:
    """Keys of a trajectory's non-array entries (what `META` describes)."""

    EPISODES = "episodes"
    CURSOR = "cursor"
    TIMING = "timing"
    WEIGHT_VERSION = "weight_version"
    WEIGHT_SYNC = "weight_sync"
    OFFLOAD_S = "offload_s"


META: tuple[tuple[str, str, str], ...] = (
    (Meta.EPISODES, "list[dict]", "the episodes that finished during the rollout (tasks.envs.shard: return, "
                                  "success, length, seed, id)"),
    (Meta.CURSOR, "dict", "the shard's lifecycle cursor after the rollout (JSON; resumes it exactly)"),
    (Meta.TIMING, "dict[str, float]", 'seconds {"env", "infer", "total"} of the rollout'),
    (Meta.WEIGHT_VERSION, "int", "the oldest weight version that acted in the rollout"),
    (Meta.WEIGHT_SYNC, "dict", '{"seconds", "bytes"} the replicas spent loading new weights (tasks.weights)'),
    (Meta.OFFLOAD_S, "float", "seconds moving the replica off / onto its device (algorithm.offload)"),
)

# ---- views of FIELDS ----------------------------------------------------------------------------------------
STEP_FIELDS = tuple(f.name for f in FIELDS if f.per_step and f.source != "advantages" and not f.when)
"""The [T, B, ...] rollout fields every trajectory has (rgb and extras/* come on top when present)."""
STORED_FIELDS = tuple(f.name for f in FIELDS if f.stored)
RECORDED_FIELDS = tuple(f.name for f in FIELDS if f.recorded)
REPLAY_FIELDS = tuple(f.name for f in FIELDS if f.replay)
SAMPLE_FIELDS = tuple(f.name for f in FIELDS if f.update)
"""The update's flattened samples (extras/* on top)."""
PASSTHROUGH = tuple(f.name for f in FIELDS if f.update and f.source != "advantages")
"""Rollout fields the update consumes unchanged (advantages passes them on)."""
POLICY_OUTPUTS = tuple(f.name for f in FIELDS if f.per_step and f.source == "policy")
ENV_OUTPUTS = tuple(f.name for f in FIELDS if f.per_step and f.source == "env")
"""What a chunk step of the env returns for the trajectory (the observation comes from the step before)."""
OBSERVATION = tuple(f.name for f in FIELDS if f.source == "observation")


def is_extra(key: str) -> bool:
    return key.startswith(EXTRAS_PREFIX)


def is_step_field(key: str) -> bool:
    """A [T, B, ...] field of a rollout: a per-step rollout Field (rgb included) or extras/*."""
    f = BY_NAME.get(key)
    return is_extra(key) or (f is not None and f.per_step and f.source != "advantages")


def is_sample_field(key: str) -> bool:
    """A field of the update's samples (`SAMPLE_FIELDS` or extras/*)."""
    return key in SAMPLE_FIELDS or is_extra(key)


def shapes(names: Iterable[str], dims: Dims) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (trailing shape, dtype)} of the named fields that exist under `dims` (rgb only with an image)."""
    out = {}
    for name in names:
        f = BY_NAME[name]
        shape = f.shape(dims)
        if shape is not None:
            out[name] = (shape, f.dtype)
    return out


def zarr_schema(dims: Dims, names: Iterable[str] = STORED_FIELDS) -> dict:
    """The trajectory store's schema: {name: storage.trajectories.FieldSpec} of the stored fields under `dims`
    (trailing dims after [T, B], dtype). `names`: a subset (e.g. `RECORDED_FIELDS`)."""
    from storage.trajectories import FieldSpec
    return {name: FieldSpec(shape, dtype) for name, (shape, dtype) in shapes(names, dims).items()}


def record_schema(dims: Dims) -> dict:
    """The schema of a demonstration store (pipelines.record): the `recorded` fields."""
    return zarr_schema(dims, RECORDED_FIELDS)


def stored_part(traj: dict) -> dict:
    """The entries of `traj` a training run's store holds (its stored fields that are present)."""
    return {k: traj[k] for k in STORED_FIELDS if k in traj}


# ---- the README table ---------------------------------------------------------------------------------------
def markdown() -> str:
    """The README's "Trajectory fields" tables (fields, then bookkeeping entries), as markdown."""
    yes = {True: "yes", False: ""}
    lines = ["| field | shape | dtype | from | stored | update | replay | meaning |",
             "|---|---|---|---|---|---|---|---|"]
    for f in FIELDS:
        lead = "T, B" if f.per_step else "B"
        shape = f"[{lead}{', ' + f.dims if f.dims else ''}]"
        meaning = f.meaning + (f" (only with {f.when})" if f.when else "")
        lines.append(f"| `{f.name}` | {shape} | {f.dtype} | {f.source} | {yes[f.stored]} | {yes[f.update]} "
                     f"| {yes[f.replay]} | {meaning} |")
    lines.append(f"| `{EXTRAS_PREFIX}<name>` | [T, B, ...] | policy's | policy | | yes | | the policy's own "
                 "tensors to recompute its log-probs (e.g. a flow VLA's denoising chain) |")
    lines += ["", "| entry | type | meaning |", "|---|---|---|"]
    lines += [f"| `{k}` | {t} | {m} |" for k, t, m in META]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tasks.trajectory", description=__doc__.splitlines()[0])
    p.add_argument("--markdown", action="store_true", help="print the README's trajectory field tables")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown())
    else:
        p.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
