"""Every key of the config is read by code that acts on it (the invariants that replaced the golden file of resolved
configs). A key no code reads does nothing: the user who sets it is misled (RLinf issue #288).

`test_every_key_arrives_where_code_reads_it`: the composed, validated config of each VARIANTS entry is made
recording: every section object it holds (whatever family class the composition picked: the fields of the actual
objects, nested ones such as `env.eval` included) is switched to a subclass of its own class that logs each read of
a field with the module that decides it. Then the graphs the runner submits (init: env dims, policy, actor; one
training step; eval and the validation split's; a checkpoint) run in this process through dask's synchronous
scheduler (no cluster), on the real simulator for the first variant. A read counts where a module outside the
rules reads it: reads by the rules (`*.checks`, `tasks.config.checks`, `pipelines.config`, `pipelines.validate`),
the composition and whole-object copies (`dataclasses`, `copy`, `pickle`) do not; a derived value
(`env.shard_size`, `tasks.config.batch`) or section method (`env.eval.split`) reads for its caller. Every key of
the env, policy, algorithm and rollout sections must be read, but GATED's (each names the value that reaches it).

`test_every_key_of_every_family_is_read_outside_the_rules`: statically, by name, for every registered family of
every section (the VLAs, LIBERO and the remote cluster kind included) and the sections only the driver or other
commands read (runner, cluster, tracking, storage, sft, record).
"""
from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import dask
import pytest
from tests.pipelines.test_graphs import FakeEnv as GraphsFakeEnv

REPO = Path(__file__).resolve().parents[2]
RUN = "20260101-000000-keys"

# Who reads: the first frame, walking out from the read, that is not in the config package's data and derived
# values (`tasks.config.schema`/`batch`, `tasks.algorithms.specs`, the families' `configuration` modules: a derived value or
# section method counts for its caller). Reads decided by the rules, the composition or a whole-object copy do not
# count.
_PASS_THROUGH = ("tasks.config.schema", "tasks.config.batch", "tasks.algorithms.specs", "tasks.config.registry")
_NOT_A_USE = ("tasks.config", "pipelines.config", "pipelines.compose", "pipelines.validate", "dataclasses", "copy",
              "copyreg", "pickle", "omegaconf", "reprlib", "pprint", "json", "pytest", "_pytest", __name__)


def _passes_through(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return module.startswith(_PASS_THROUGH) or last in ("configuration", "vla_configuration")


def _counts(module: str) -> bool:
    """Whether a read decided by `module` is a use of the key (not the rules, the composition or a copy)."""
    last = module.rsplit(".", 1)[-1]
    return not module.startswith(_NOT_A_USE) and last != "checks" and ".checks." not in module


def _reader(depth: int) -> str:
    """The module that decides a read made `depth` frames up (skipping `_PASS_THROUGH` frames)."""
    frame = sys._getframe(depth + 1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not _passes_through(module):
            return module
        frame = frame.f_back
    return ""


class _Log:
    """Key -> the modules whose reads of it count."""

    def __init__(self):
        self.reads: dict[str, set[str]] = {}


_LOG: _Log | None = None
_CLASSES: dict[tuple[type, str], type] = {}


def _recording_class(cls: type, prefix: str) -> type:
    """A subclass of dataclass `cls` that logs reads of its fields as `prefix + name` into `_LOG`."""
    key = (cls, prefix)
    if key not in _CLASSES:
        names = {f.name for f in dataclasses.fields(cls)}

        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            log = _LOG
            if log is not None and name in names and not dataclasses.is_dataclass(value):
                module = _reader(1)
                if _counts(module):
                    log.reads.setdefault(prefix + name, set()).add(module)
            return value

        _CLASSES[key] = type(f"Recording{cls.__name__}", (cls,), {"__getattribute__": __getattribute__,
                                                                  "__module__": cls.__module__})
    return _CLASSES[key]


def _make_recording(obj, prefix: str, keys: dict[str, object]) -> None:
    """Switch `obj` (a dataclass instance) and the dataclasses it holds to recording classes; `keys` gets every leaf
    key (the fields of the actual objects) with its value."""
    for f in dataclasses.fields(obj):
        value = object.__getattribute__(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _make_recording(value, f"{prefix}{f.name}.", keys)
        else:
            keys[prefix + f.name] = value
    object.__setattr__(obj, "__class__", _recording_class(type(obj), prefix))  # a frozen section refuses `obj.x =`


@pytest.fixture
def recording():
    """Start a fresh log; the resident state made in this process is released after the test."""
    global _LOG
    from tasks import resident
    resident.release("")
    _LOG = _Log()
    try:
        yield _LOG
    finally:
        _LOG = None
        resident.release("")


def _placement(cfg):
    """A placement of made-up worker addresses: one env worker per shard, one actor worker (also the rollout's)."""
    from pipelines.clusters import Placement
    shards = [f"tcp://127.0.0.1:{4000 + s}" for s in range(cfg.env.num_shards)]
    return Placement(shard_workers=shards, actor_worker="tcp://127.0.0.1:5000")


def _drive(cfg, tmp_path: Path) -> None:
    """Init, one training step, eval (and the validation split's), a checkpoint: the graphs the runner submits, run
    in this process."""
    from pipelines import graphs
    placement = _placement(cfg)
    init = graphs.build_init(cfg, run_id=RUN, placement=placement, checkpoint_path=None)
    dims, weights = dask.get(init.graph, [init.dims, init.weights])
    shards = cfg.env.num_shards
    step = graphs.build_train_step(cfg, run_id=RUN, step=0, weights=weights, cursors=[None] * shards,
                                   placement=placement, store_path=None, dims=dims)
    upd, met, *_ = dask.get(step.graph, [step.update, step.metrics, *step.trajs])
    for split in ("eval", "val") if cfg.env.eval.val_episodes else ("eval",):  # as the runner's eval
        graph, keys = graphs.build_eval(cfg, run_id=RUN, step=1, weights=upd, placement=placement, split=split)
        dask.get(graph, keys)
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True)
    graph, key = graphs.build_checkpoint(run_id=RUN, step=1, run_dir=str(run_dir), meta={"step": 1},
                                         placement=placement, cfg=cfg, weights=upd, dims=dims)
    dask.get(graph, key)


class FakeEnv(GraphsFakeEnv):
    """tests/pipelines/test_graphs.py's stand-in simulator (obs = [t/10, seed/100, 1], reward = mean action,
    truncated after 4 steps), also built with a render size, for the variants that take the code paths of other
    keys: the env family's own keys are read by the real one."""

    def __init__(self, cfg=None, render_size=None):
        super().__init__(cfg)


# variants of conf=smoke (mlp policy, ManiSkill env, state observations) that between them take every code path a
# key of the env, policy, algorithm and rollout sections gates: PPO with GAE and colocated inference on the real
# simulator; GRPO with filtered rewards and a validation split, and disaggregated inference in 2 pipeline stages,
# on FakeEnv (True: the real simulator)
VARIANTS = {
    "ppo": (True, ["conf=smoke", "rollout.chunk_steps=4", "rollout.chunk_steps_per_node=2", "env.num_envs=2",
                   "env.num_shards=1", "env.max_episode_steps=6", "env.eval.num_envs=1", "env.eval.num_episodes=1"]),
    "grpo": (False, ["conf=smoke", "rollout.chunk_steps=4", "rollout.chunk_steps_per_node=2", "algorithm=grpo",
                     "algorithm.group_size=2", "algorithm.filter_rewards=true", "env.eval.val_episodes=2"]),
    "disaggregated": (False, ["conf=smoke", "rollout.chunk_steps=4", "rollout.inference=disaggregated",
                              "rollout.pipeline_stage_num=2"]),
}
DYNAMIC = ("env.", "policy.", "algorithm.", "rollout.", "seed")
# keys these variants cannot reach (each with the value that would): checked to stay unread, so an entry goes away
# when a variant starts reading its key
GATED = {
    "algorithm.global_batch_size": "algorithm.num_actor_ranks > 1 (the distributed actor's batch plan)",
    "algorithm.nonfinite": "a NaN/inf in a rollout field the update reads (tests/tasks/envs/test_lifecycle.py)",
    "env.image_size": "env.obs_mode=rgb, which a VLA policy needs and the mlp refuses (the cluster tier's VLA runs)",
}


@pytest.mark.sim  # the first variant's ManiSkill scene
def test_every_key_arrives_where_code_reads_it(recording, tmp_path, monkeypatch):
    import tasks.envs
    from pipelines.config import load_config
    from tasks import resident
    keys: dict[str, object] = {}
    real = tasks.envs.make_single_env
    for name, (simulator, overrides) in VARIANTS.items():
        cfg, _ = load_config([*overrides, f"run_root={tmp_path / 'runs'}"], components=False)
        _make_recording(cfg, "", keys)
        monkeypatch.setattr(tasks.envs, "make_single_env", real if simulator else FakeEnv)
        _drive(cfg, tmp_path / name)
        resident.release("")
    wanted = {k for k in keys if k.startswith(DYNAMIC)}
    unread = sorted(wanted - set(recording.reads) - set(GATED))
    assert not unread, f"{len(unread)} of {len(wanted)} keys are read by no code path: {unread}"
    stale = sorted(set(GATED) & set(recording.reads))
    assert not stale, f"read now, leave GATED: {stale}"


def _attribute_reads(roots: list[Path]) -> set[str]:
    """Every name read as an attribute (`x.name`) or named by a string (`getattr(x, "name")`, a tuple of field names
    a loop reads) in the .py files under `roots`, in the
    modules whose reads count (the config package's derived values included: `tasks.config.batch`, ...)."""
    names: set[str] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if not (_counts(module) or module.startswith(_PASS_THROUGH)) or _passes_through(module) and \
                    not module.startswith(_PASS_THROUGH):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                    names.add(node.value)  # getattr(section, name) over a tuple of names (pipelines.clusters.tls)
    return names


def _leaf_keys(cls: type, prefix: str) -> dict[str, type]:
    """`prefix + name` -> owning class, for every field of dataclass `cls` (nested dataclasses walked)."""
    import typing
    hints = typing.get_type_hints(cls)
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        t = hints.get(f.name)
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out.update(_leaf_keys(t, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = cls
    return out


def test_every_key_of_every_family_is_read_outside_the_rules():
    """Every key of every section, for every registered family of a section that has families (policy, env,
    cluster: tasks.config.registry), is read as an attribute somewhere in pipelines/, tasks/ or storage/ outside
    the config package's rules and the families' configuration modules. Static and by name (a key whose name some
    other object also has passes): the floor under every family, including those the test above does not run (the
    VLAs, LIBERO, the remote cluster) and the sections only the driver reads (runner, cluster, tracking, storage,
    sft, record)."""
    from tasks.config import Config
    from tasks.config.registry import SELECTORS, families
    import typing
    keys: dict[str, type] = {}
    for f in dataclasses.fields(Config):
        t = typing.get_type_hints(Config).get(f.name)
        if not (isinstance(t, type) and dataclasses.is_dataclass(t)):
            keys[f.name] = Config
        elif f.name in SELECTORS:
            for cls in families(f.name).values():
                keys.update(_leaf_keys(cls, f"{f.name}."))
        else:
            keys.update(_leaf_keys(t, f"{f.name}."))
    reads = _attribute_reads([REPO / "pipelines", REPO / "tasks", REPO / "storage"])
    unread = sorted(f"{k} ({c.__name__})" for k, c in keys.items() if k.rsplit(".", 1)[-1] not in reads)
    assert len(keys) > 100 and not unread, f"read by no code outside the rules: {unread}"
