"""Fixtures and helpers that several test modules share (the default suite's time budget: README "Tests").

- `smoke_run` (session): ONE `conf=smoke` run (filming 1 eval episode: runner.eval_videos=1) through
  `pipelines.run.main` (its own embedded cluster), used by tests/test_end_to_end.py (what it logged, stored and
  filmed) and tests/test_vla_recipe.py (the recipe's state teacher).
- one cluster per layout (section at the end): a `cluster` test's in-process runs share the test process's kept
  embedded cluster of their layout (what a user does with `cluster.address`), with every resident object of the
  earlier runs dropped first, as a fresh cluster would have none; `fresh_cluster` marks a test that needs its own.
  `reused_clusters` (a context manager, given as a fixture) turns the sharing on for a block whatever the test.

Every test gets exactly one tier mark, `unit` / `sim` / `cluster` (section "test tiers" below: assigned from the
test's own mark, the fixtures it uses or TIERS, else `unit`; checked at run time). `pytest -m unit` is the default
selection's unit tier: a `-m` expression that does not name `slow` (`gpu`) leaves those tests out as the default does.

A test session started with SIGINT ignored (a background job of a script: `pytest ... &`) gets Python's default
SIGINT handler back first: the interruption tests send real SIGINTs, to this process and to the runs they start
(which inherit an ignored SIGINT and keep ignoring it, `pipelines.cli.signal_handlers`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import signal

import pytest

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _scheduler_state(dask_scheduler=None) -> tuple:
    """(worker statuses by name, worker plugin names, nanny plugin names) as the scheduler holds them."""
    workers = sorted((str(ws.name), str(ws.status)) for ws in dask_scheduler.workers.values())
    return workers, sorted(dask_scheduler.worker_plugins), sorted(getattr(dask_scheduler, "nanny_plugins", {}))


def _cluster_state(client) -> tuple:
    """What a kept cluster must still have to be reused (`_scheduler_state`); a worker killed, paused or added, or a
    plugin a test registered, changes it."""
    return client.run_on_scheduler(_scheduler_state)


class _ClusterPool:
    """The embedded clusters this test process keeps for reuse (section "one cluster per layout" below): at most
    KEEP at once (the least recently used is closed first), keyed by what a cluster start depends on."""

    KEEP = 2  # layouts kept at once: the suite's common one survives a test of another layout (A, B, A)

    def __init__(self) -> None:
        # key -> (the real handle, `_cluster_state` at start), least recently used first
        self.started: dict[str, tuple[object, tuple]] = {}
        self.on = False  # the running test wants the pool (`_wants_pool`)
        self.forced = 0  # open `_reused_clusters` blocks

    @staticmethod
    def key(cfg) -> str:
        """What the workers of an embedded cluster depend on: its `cluster` section, the simulator (the worker
        processes' set-up) and the environment the env workers start with: the driver's variables (they inherit
        them: a test that sets one gets workers that see it) with the simulator's `tasks.envs.worker_env` on top
        (`pipelines.clusters.local`), less what is set in this process the same way every time: distributed's
        `nanny.pre-spawn-environ`, PYTHONHASHSEED and `__DASK_*`, pytest's PYTEST_CURRENT_TEST, MLflow's telemetry
        session id. So a sim test that set this process's VK_ICD_FILENAMES to the ICD the env workers get anyway
        (`tasks.envs.maniskill.vulkan.ensure_vulkan`) starts no new cluster (the GPU workers, which inherit the
        variable alone, build no simulator)."""
        import os

        import dask
        import distributed  # noqa: F401 - its config defaults

        from tasks.envs import worker_env
        spawn = {*dask.config.get("distributed.nanny.pre-spawn-environ", {}), "PYTHONHASHSEED"}
        spawn.add("PYTEST_CURRENT_TEST")  # pytest's own, another value in every test
        try:
            extra = worker_env(cfg.env)
        except Exception:  # noqa: BLE001 - no driver: the real start raises it
            extra = {}
        env = sorted((k, v) for k, v in {**os.environ, **extra}.items()
                     if k not in spawn and not k.startswith(("__DASK", "_MLFLOW_TELEMETRY")))
        return repr((dataclasses.asdict(cfg.cluster), cfg.env.simulator, env))

    def start(self, real, cfg):
        """The kept cluster of `cfg`'s key (resident objects dropped), else `real(cfg)`, kept beside at most KEEP - 1
        others (the least recently used is closed); a handle whose `close()` leaves it up."""
        import os

        from tasks import resident
        key = self.key(cfg)
        closed: list[str] = []  # the kept layouts this start closed (DAGRL_TEST_POOL_LOG)
        if key in self.started:
            h, state = self.started.pop(key)
            self.started[key] = (h, state)  # the most recently used
            try:  # what a new cluster starts from: the same workers, running, with the same plugins (a test's
                # fault injection, `pipelines.faults`, is a plugin) and no resident object of an earlier run
                healthy = _cluster_state(h.client) == state
                if healthy:
                    h.client.run(resident.release, "", on_error="ignore")
            except Exception:  # noqa: BLE001 - a cluster an earlier test broke is replaced
                healthy = False
            if not healthy:
                self.started.pop(key)
                closed.append(key)
                with contextlib.suppress(Exception):
                    h.close()
        note, new = None, key not in self.started  # the note is printed once, when the cluster comes up
        if new:
            while len(self.started) >= self.KEEP:  # memory: the least recently used layout is closed
                closed.append(next(iter(self.started)))
                with contextlib.suppress(Exception):
                    self.started.pop(closed[-1])[0].close()
            h = real(cfg)
            self.started[key], note = (h, _cluster_state(h.client)), h.note
        if os.environ.get("DAGRL_TEST_POOL_LOG"):  # which starts the pool served, and which kept layouts it closed
            with open(os.environ["DAGRL_TEST_POOL_LOG"], "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "reused": not new,
                                    "closed": closed, "key": key}) + "\n")
        h = self.started[key][0]
        return _kept_handle(h, note)

    def close(self) -> None:
        while self.started:
            h, _ = self.started.popitem()[1]
            with contextlib.suppress(Exception):
                h.close()


_POOL = _ClusterPool()


def _kept_handle(h, note):
    """A `pipelines.clusters.ClusterHandle` of `h`'s client and cluster whose `close()` does nothing (the pool
    closes the real one)."""
    import pipelines.clusters as pc

    class _Kept(pc.ClusterHandle):
        def close(self) -> None:
            pass

    return _Kept(h.client, h.cluster, h.dashboard_link, note)


def _pool_start(real):
    """`pipelines.clusters.start_cluster` as the pool gives it out: an embedded cluster from the pool while the pool
    is on (`_POOL.on`: a test that wants it is running, or inside `_reused_clusters`), else `real`."""
    def start(cfg):
        if cfg.cluster.kind != "local" or not (_POOL.on or _POOL.forced):  # only the embedded cluster is reused
            return real(cfg)
        return _POOL.start(real, cfg)
    start.dagrl_pool = True
    return start


@contextlib.contextmanager
def _reused_clusters():
    """Within the block every `pipelines.clusters.start_cluster(cfg)` of an embedded cluster (`cluster.kind=local`)
    whose layout, simulator and environment equal an earlier start's returns the same running workers, with every
    resident object of the earlier runs dropped first (what a new cluster starts from), as a user does with
    `cluster.address`; `close()` of the handles it gives out does nothing (the session's end, or a start of
    another layout when `_ClusterPool.KEEP` are kept, closes the cluster). An existing cluster (`cluster.kind=address`) is not touched."""
    import pipelines.clusters as pc
    with pytest.MonkeyPatch.context() as mp:
        if not getattr(pc.start_cluster, "dagrl_pool", False):
            mp.setattr(pc, "start_cluster", _pool_start(pc.start_cluster))
        _POOL.forced += 1
        try:
            yield
        finally:
            _POOL.forced -= 1


@pytest.fixture(scope="session")
def cluster_pool_parts():
    """(`_ClusterPool`, `_scheduler_state`), for tests/test_cluster_pool.py (a fixture: `import conftest` is
    ambiguous)."""
    return _ClusterPool, _scheduler_state


@pytest.fixture(scope="session")
def reused_clusters():
    """The `_reused_clusters` context manager (a fixture: two conftest.py files make `import conftest` ambiguous)."""
    return _reused_clusters


def _built_once(tmp_path_factory, name: str, build):
    """A directory `build(path)` filled once for the whole test session, its pytest-xdist processes included: the
    first process that asks builds it under a file lock in the session's shared temporary directory, the others
    wait for that build and get the same path (pytest-xdist's docs, "Making session-scoped fixtures execute only
    once"). A build that raised leaves no `.done` mark, so the next asker builds again (and fails the same way).
    What is built must be read-only for its users, or written only in ways that no other test reads."""
    import os
    import shutil

    from filelock import FileLock
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/ holds every xdist process's popen-gwK/
    path, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # a failed build's leftovers
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """`_built_once` as a fixture (a module's own build shared by the xdist processes): `built_once(name, build)`."""
    return lambda name, build: _built_once(tmp_path_factory, name, build)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory):
    """The run root of one `conf=smoke` run (experiment dir `smoke/`, MLflow under the root), exit code asserted,
    built once for the session (`_built_once`: the xdist processes share it). Its one eval (step 3, the last) films
    one episode although 3 is no multiple of `runner.eval_video_interval`. Tests read it; `pipelines.eval` writes
    its own records beside it (test_eval_cli.py, the one test that does)."""
    def build(root):
        from pipelines.run import main
        assert main(["conf=smoke", f"run_root={root}", "cluster.dashboard_address=127.0.0.1:0",
                     "runner.eval_videos=1", "runner.eval_video_interval=2"]) == 0
    return _built_once(tmp_path_factory, "smoke_run", build)


# ----- test tiers (README "Tests"): every test is exactly one of `unit`, `sim`, `cluster` -----
#
# `unit`: starts no simulator and no cluster; `sim`: starts a simulator (a ManiSkill/SAPIEN scene, a LIBERO/robosuite
# env), no cluster; `cluster`: starts a Dask cluster (embedded or a Client to one) or a real run (a `pipelines.run /
# record / eval / replay` process, the compose file's services). A test's tier, first match wins:
#   1. a tier mark on the test, its class or its module (`pytestmark = pytest.mark.sim`);
#   2. a fixture it uses, directly or through other fixtures: TIER_FIXTURES, or TIERS' `file::@fixture` entries;
#   3. TIERS: `file::pattern` (fnmatch on the test's name, parameters left out), then `file`;
#   4. `unit`.
# The guard checks the tiers at run time: a test that starts a simulator or a cluster above its tier fails (in its
# teardown) naming what it started. `--tiers-probe=PATH` writes, per test, its tier and what it started (JSON
# lines) and stops each cluster or real run as it starts (the test then fails fast): one pass over every test costs
# the unit and sim tests only, and tells which tests TIERS must name.

TIER_ORDER = ("unit", "sim", "cluster")

TIER_FIXTURES = {"smoke_run": "cluster", "reused_clusters": "cluster"}

TIERS: dict[str, str] = {
    # whole files
    "tests/test_end_to_end.py": "cluster",
    "tests/test_libero_smoke.py": "cluster",
    "tests/test_vla_recipe.py": "cluster",
    "tests/pipelines/test_actor_ranks.py": "cluster",
    "tests/pipelines/test_libero_eval.py": "cluster",
    "tests/pipelines/test_libero_pi0.py": "cluster",
    "tests/pipelines/test_recovery_async.py": "cluster",
    # the tests of a file that start a cluster or a real run
    "tests/pipelines/test_async.py::test_smoke_run_with_max_staleness_one": "cluster",
    "tests/pipelines/test_async.py::test_killed_env_worker_with_steps_in_flight_is_recovered": "cluster",
    "tests/pipelines/test_cli.py::test_validate_connect_lists_the_workers_and_what_goes_where": "cluster",
    "tests/pipelines/test_cli.py::test_ctrl_c_on_a_real_run_prints_one_line": "cluster",
    "tests/pipelines/test_cli.py::test_sigterm_to_the_whole_process_group_checkpoints_the_finished_steps": "cluster",
    "tests/pipelines/test_cluster_security.py::test_tls_embedded_cluster_and_a_tls_client": "cluster",
    "tests/pipelines/test_compose.py::test_compose_commands_run_the_smoke_experiment": "cluster",
    "tests/pipelines/test_config.py::test_cli_bad_config_exits_2_with_one_line_and_writes_nothing": "cluster",
    "tests/pipelines/test_config.py::test_cluster_address_that_never_answers_fails_fast": "cluster",
    "tests/pipelines/test_failing_cleanly.py::test_cluster_info_asks_the_scheduler_not_the_clients_cache": "cluster",
    "tests/pipelines/test_failing_cleanly.py::test_run_dir_removed_mid_run_is_one_line_exit_1_nothing_recreated":
        "cluster",
    "tests/pipelines/test_input_identity.py::test_a_re_recorded_sft_store_is_refused_on_resume": "cluster",
    "tests/pipelines/test_perf.py::@cluster": "cluster",
    "tests/pipelines/test_placement.py::test_embedded_cluster_workers_keep_glibc_malloc_defaults": "cluster",
    "tests/pipelines/test_recovery.py::@cluster": "cluster",
    "tests/pipelines/test_recovery.py::test_memory_paused_cluster_exits_with_one_line": "cluster",
    "tests/pipelines/test_replay.py::@run_dir": "cluster",
    "tests/pipelines/test_resume.py::test_*_resume_is_exact": "cluster",
    "tests/pipelines/test_resume.py::test_sigint_checkpoints_the_step_and_resume_latest_continues_that_run": "cluster",
    "tests/pipelines/test_resume.py::test_rollback_redoes_the_steps_after_the_checkpoint_in_one_timeline": "cluster",
    "tests/pipelines/test_resume.py::test_exact_resume_of_the_default_job_replays_the_uninterrupted_run": "cluster",
    "tests/pipelines/test_resume.py::test_store_marks_a_step_complete_*": "cluster",
    "tests/pipelines/test_run_errors.py::test_nan_policy_stops_with_one_line_naming_the_step": "cluster",
    "tests/pipelines/test_run_lock.py::test_two_real_drivers_on_one_run": "cluster",
    "tests/storage/test_best_checkpoint.py::test_smoke_run_*": "cluster",
    "tests/tasks/test_resident.py": "cluster",  # in-process LocalClusters are clusters too
    "tests/tasks/test_ema.py::test_smoke_runs_with_and_without_an_average": "cluster",
    "tests/tasks/test_weights.py::@client": "cluster",
    "tests/tasks/envs/test_libero_expert.py::test_record_cli_*": "cluster",
    # the tests of a file that start a simulator
    "tests/tasks/envs/test_maniskill.py": "sim",
    "tests/tasks/envs/test_maniskill_fast.py": "sim",
    "tests/tasks/envs/test_batched.py::test_maniskill_gpu_shard_*": "sim",
    "tests/tasks/envs/test_libero.py::test_mujoco_replays_bit_exactly_in_another_process": "sim",
    "tests/tasks/envs/test_libero.py::test_bowl_on_ramekin_all_50_init_states_*": "sim",
    "tests/tasks/envs/test_libero_expert.py::@env": "sim",
    "tests/tasks/envs/test_lifecycle.py::test_maniskill_shard_resumes_mid_episode_exactly": "sim",
    "tests/tasks/envs/test_mesh_lod.py::test_lod_keeps_the_dynamics_bit_exact_and_the_image_close": "sim",
    "tests/tasks/envs/test_libero.py::@env": "sim",
    "tests/tasks/envs/test_libero.py::@object_env": "sim",
    "tests/tasks/envs/test_libero_wrist.py::@wrist_env": "sim",
    "tests/tasks/envs/test_libero.py::test_libero_object_golden_frame": "sim",
}

_started: list[str] = []  # what the running test started: "cluster: ..." / "sim: ..."
_fixture_started: dict[tuple[str, str], list[str]] = {}  # (baseid, name) of a fixture -> what its setup started
_probe = {"on": False}


class TierProbeStop(RuntimeError):
    """Raised by `--tiers-probe` where a cluster or a real run would start."""


def _record(kind: str, what: str) -> None:
    _started.append(f"{kind}: {what}")
    if kind == "cluster" and _probe["on"]:
        raise TierProbeStop(f"tiers probe: {what} not started")


def _wrap_init(cls, kind: str, what: str) -> None:
    init = cls.__init__
    if getattr(init, "_tier_wrapped", False):
        return

    def __init__(self, *a, **kw):
        _record(kind, what)
        return init(self, *a, **kw)

    __init__._tier_wrapped = True
    cls.__init__ = __init__


# module -> what to wrap once it is imported (nothing heavy is imported here)
_WATCHED = {
    "distributed.deploy.spec": lambda m: _wrap_init(m.SpecCluster, "cluster", "a Dask cluster (SpecCluster)"),
    "distributed.client": lambda m: _wrap_init(m.Client, "cluster", "a Dask Client"),
    "sapien.wrapper.scene": lambda m: _wrap_init(m.Scene, "sim", "a SAPIEN scene"),
    "mani_skill.envs.sapien_env": lambda m: _wrap_init(m.BaseEnv, "sim", "a ManiSkill env"),
    "robosuite.environments.base": lambda m: _wrap_init(m.MujocoEnv, "sim", "a robosuite/LIBERO env"),
}
_RUN_MODULES = ("pipelines.run", "pipelines.record", "pipelines.eval", "pipelines.replay", "distributed", "dask",
                "mlflow")


def _run_in(args) -> str | None:
    """The run a process of argv `args` is (`python -m pipelines.run ...`, `dask scheduler`, `mlflow server`), or
    None (a `python -c` snippet, a linter, ...)."""
    import os
    argv = args.split() if isinstance(args, str) else [os.fsdecode(a) for a in args]
    if not argv:
        return None
    prog = os.path.basename(argv[0])
    if prog.split("-")[0] in ("dask", "mlflow"):
        return " ".join([prog, *argv[1:2]])
    if "-m" in argv[:-1]:
        mod = argv[argv.index("-m") + 1]
        if mod.split(".")[0] in ("dask", "distributed", "mlflow") or mod in _RUN_MODULES:
            return f"python -m {mod}"
    return None


class _AfterImport:
    """A meta-path finder that wraps the `_WATCHED` classes right after their modules execute."""

    def find_spec(self, name, path=None, target=None):
        if name not in _WATCHED:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _WATCHED[name](module)

        spec.loader.exec_module = exec_module
        return spec


def _install_watch() -> None:
    import subprocess
    import sys
    for name, wrap in _WATCHED.items():
        if name in sys.modules:
            wrap(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport())
    popen = subprocess.Popen.__init__

    def __init__(self, args, *a, **kw):
        what = _run_in(args)
        if what:
            _record("cluster", f"a `{what}` process")
        return popen(self, args, *a, **kw)

    subprocess.Popen.__init__ = __init__


def _tier_of(item) -> tuple[str, str]:
    """(tier, where it came from) of a collected test; ValueError for two different tier marks."""
    import fnmatch
    marks = {m.name for m in item.iter_markers() if m.name in TIER_ORDER}
    if len(marks) > 1:
        raise ValueError(f"{item.nodeid}: marked {sorted(marks)}; a test has exactly one tier")
    if marks:
        return marks.pop(), "its mark"
    path = item.path.relative_to(item.config.rootpath).as_posix()
    used = [TIERS[f"{path}::@{f}"] for f in item.fixturenames if f"{path}::@{f}" in TIERS]
    used += [TIER_FIXTURES[f] for f in item.fixturenames if f in TIER_FIXTURES]
    if used:
        return max(used, key=TIER_ORDER.index), "a fixture it uses"
    name = getattr(item, "originalname", None) or item.name
    for key, tier in TIERS.items():
        file, _, pattern = key.partition("::")
        if file == path and pattern and not pattern.startswith("@") and fnmatch.fnmatchcase(name, pattern):
            return tier, f"TIERS[{key!r}]"
    if path in TIERS:
        return TIERS[path], f"TIERS[{path!r}]"
    return "unit", "the default"


def pytest_addoption(parser):
    parser.addoption("--tiers-probe", metavar="PATH", default=None,
                     help="write each test's tier and what it started (JSON lines); stop clusters as they start")


def pytest_configure(config):
    _probe["on"] = bool(config.getoption("--tiers-probe"))
    _install_watch()
    config.addinivalue_line("markers", "fresh_cluster: the test's runs start their own embedded clusters, not the "
                                       "process's kept one (tests/conftest.py, `_wants_pool`)")
    config.addinivalue_line("markers", "real_mlflow_schema: a new MLflow store's schema is built by MLflow's "
                                       "migrations, not copied (tests/conftest.py, `_mlflow_schema_template`)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Give every collected test its one tier mark (before `-m` selects)."""
    bad = []
    for item in items:
        try:
            tier, why = _tier_of(item)
        except ValueError as e:
            bad.append(str(e))
            continue
        item.add_marker(getattr(pytest.mark, tier))
        item.stash[_TIER] = (tier, why)
    if bad:
        raise pytest.UsageError("\n".join(bad))
    # `-m EXPR` replaces addopts' `-m 'not slow and not gpu'`: an EXPR that does not name `slow` (`gpu`) keeps
    # the slow (gpu) tests out as the default selection does, so `pytest -m unit` is the default selection's unit tier
    expr = config.getoption("markexpr") or ""  # "" (`-m ""`): every test, as before
    out = [m for m in ("slow", "gpu") if expr and m not in expr]
    if out:
        kept = [i for i in items if not any(i.get_closest_marker(m) for m in out)]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept


_TIER = pytest.StashKey[tuple]()
_OUTCOME = pytest.StashKey[str]()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """What a fixture's setup starts belongs to every test that uses the fixture (a module-scoped cluster is
    started by the first one)."""
    before = len(_started)
    try:
        yield
    finally:
        if len(_started) > before:
            _fixture_started[(fixturedef.baseid, fixturedef.argname)] = _started[before:]


def _used_starts(item) -> list[str]:
    """What the fixtures `item` uses started, whichever test set them up."""
    out = []
    for name, defs in getattr(item, "_fixtureinfo").name2fixturedefs.items():
        if defs:
            out += _fixture_started.get((defs[-1].baseid, name), [])
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed or call.when == "call":
        item.stash[_OUTCOME] = f"{call.when} {report.outcome}"
    if call.when != "teardown":
        return
    tier, why = item.stash.get(_TIER, ("unit", "the default"))
    started = list(dict.fromkeys(_started + _used_starts(item)))
    path = item.config.getoption("--tiers-probe")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"nodeid": item.nodeid, "tier": tier, "why": why, "started": started,
                                "outcome": item.stash.get(_OUTCOME, "?")}) + "\n")
        return
    need = max((s.split(":")[0] for s in started), key=TIER_ORDER.index, default="unit")
    if TIER_ORDER.index(need) > TIER_ORDER.index(tier) and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"tier: this test is `{tier}` ({why}) but started {'; '.join(started)}: mark it "
                           f"`{need}` (a mark, or TIERS in tests/conftest.py)")


# ----- one MLflow schema per session (the unit tier's time, README "Tests") -----
#
# MLflow builds a new sqlite store's schema with its initial tables and ~40 alembic migrations
# (`mlflow.store.db.utils._initialize_tables`): ~1-2 s of CPU and a few hundred fsyncs (5-8 s under load) for every
# store a test creates. In this process the first build is real and kept as a file (a session temporary); every
# later one copies that file into the new database with sqlite's backup API, logging MLflow's two INFO lines as the
# real one does. The copy is MLflow's own schema at MLflow's head revision and nothing else: the Default experiment
# and the artifact root are then made by MLflow (SqlAlchemyStore creates them on a store that lacks them), for the
# new store's path. `tests/test_mlflow_schema_template.py` checks that a copied store equals a built one. Processes
# a test starts build their schema for real; a test marked `real_mlflow_schema` (or one that runs before anything
# imported `mlflow.store.db.utils`) builds it for real too.

_SCHEMA_TEMPLATE: dict = {}  # "path": the file whose schema a real `_initialize_tables` built, "real": that function


def _copy_schema_template(engine) -> None:
    """`_initialize_tables(engine)` for a sqlite file database: the kept schema copied in (built at the first
    call, by the real function)."""
    import logging
    import sqlite3
    import tempfile
    from pathlib import Path

    import sqlalchemy
    real = _SCHEMA_TEMPLATE["real"]
    if engine.dialect.name != "sqlite" or not engine.url.database or engine.url.database == ":memory:":
        return real(engine)
    if "path" not in _SCHEMA_TEMPLATE:
        path = Path(tempfile.mkdtemp(prefix="dagrl-tests-mlflow-schema-")) / "schema.db"
        built = sqlalchemy.create_engine(f"sqlite:///{path}")
        real(built)
        built.dispose()
        _SCHEMA_TEMPLATE["path"] = path
    log = logging.getLogger("mlflow.store.db.utils")  # what the real function logs
    log.info("Creating initial MLflow database tables...")
    log.info("Updating database tables")
    src = sqlite3.connect(_SCHEMA_TEMPLATE["path"])
    raw = engine.raw_connection()
    try:
        src.backup(raw.driver_connection)
    finally:
        raw.close()
        src.close()


@pytest.fixture(autouse=True)
def _mlflow_schema_template(request):
    """In this test, a new MLflow sqlite store gets the session's kept schema (the section above), unless the test
    is marked `real_mlflow_schema` or `mlflow.store.db.utils` is not imported yet."""
    import sys
    utils = sys.modules.get("mlflow.store.db.utils")
    if utils is None or request.node.get_closest_marker("real_mlflow_schema"):
        yield
        return
    _SCHEMA_TEMPLATE.setdefault("real", utils._initialize_tables)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(utils, "_initialize_tables", _copy_schema_template)
        yield


# ----- one cluster per layout (the default suite's time, README "Tests") -----
#
# A `cluster` test's in-process runs (`pipelines.run.main`, `record`, `eval`, ...) start their embedded cluster
# through the pool (`_pool_start`): the first run of a layout starts it, every later run of the same layout, simulator and
# environment (in any later test of this process) gets the same workers with every resident object dropped, as a run
# on `cluster.address` does; two layouts are kept at most (`_ClusterPool.KEEP`). A conf=smoke run then costs ~6 s instead of ~30 s (and half the CPU): the worker
# processes' start, imports and close are what is left out. A kept cluster whose workers changed (killed, paused)
# or that got a plugin (`pipelines.faults`) is replaced at the next start. A test that needs workers of its own (it
# counts cluster starts, say) is marked `fresh_cluster`; `slow` tests keep their own. Processes a test starts
# (`python -m pipelines.run`) start their own clusters as always.


def _wants_pool(item) -> bool:
    """A `cluster` test of the default selection not marked `fresh_cluster` (the slow job's long runs keep their
    own clusters, as they were measured and checked)."""
    return (item.stash.get(_TIER, ("unit", ""))[0] == "cluster"
            and item.get_closest_marker("fresh_cluster") is None and item.get_closest_marker("slow") is None)


def _install_pool(module) -> None:
    """`pipelines.clusters.start_cluster` goes through the pool from its import on (`_WATCHED`); the pool serves the
    tests that want it (`pytest_runtest_setup` sets `_POOL.on` per test, before its fixtures: a module fixture's
    runs are served for the test that sets it up)."""
    if not getattr(module.start_cluster, "dagrl_pool", False):
        module.start_cluster = _pool_start(module.start_cluster)


_WATCHED["pipelines.clusters"] = _install_pool


def pytest_sessionfinish(session, exitstatus):
    import shutil
    _POOL.close()
    if "path" in _SCHEMA_TEMPLATE:  # the kept MLflow schema's temporary directory
        shutil.rmtree(_SCHEMA_TEMPLATE["path"].parent, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _started.clear()
    _POOL.on = _wants_pool(item)
