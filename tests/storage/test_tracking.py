import math
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from storage.tracking import Tracker, default_tracking_uri, flatten_config


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    # one sqlite db for the module: creating the schema costs ~1 s
    return default_tracking_uri(tmp_path_factory.mktemp("mlflow"))


def test_default_uri_convention(tmp_path):
    uri = default_tracking_uri(tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert uri.startswith("sqlite:////")


def test_flatten_config():
    cfg = {"algo": {"name": "ppo", "gamma": 0.99, "clip": {"low": 0.2, "high": 0.28}},
           "env": {"ids": ["a", "b"], "num_envs": 8, "extra": {}}, "seed": 1, "notes": None}
    assert flatten_config(cfg) == {
        "algo.name": "ppo", "algo.gamma": "0.99", "algo.clip.low": "0.2", "algo.clip.high": "0.28",
        "env.ids": '["a", "b"]', "env.num_envs": "8", "env.extra": "{}", "seed": "1", "notes": "None",
    }
    assert flatten_config({"a": {"b": 1}}, prefix="cfg", sep="/") == {"cfg/a/b": "1"}


def test_params_metrics_artifacts(uri, tmp_path):
    tr = Tracker(uri=uri, experiment="exp-a", run_name="first")
    client = MlflowClient(tracking_uri=uri)
    params = {f"p{i:03d}": i for i in range(250)}  # three batches of <= 100
    params["long"] = "x" * 7000
    assert tr.log_params(params) == 251
    got = client.get_run(tr.run_id).data.params
    assert got["p000"] == "0" and got["p249"] == "249"
    assert got["long"] == "x" * 6000
    assert len(got) == 251
    assert client.get_run(tr.run_id).info.run_name == "first"

    for step in range(3):
        n = tr.log_metrics({"train/loss": 1.0 / (step + 1), "rollout/return": float(step), "train/bad": math.nan},
                           step=step)
        assert n == 3  # NaN is logged, never dropped
    tr.log_metrics({"train/inf": math.inf, "train/ninf": -math.inf}, step=3)
    assert tr.nonfinite_logged == 5
    assert tr.get_metric_history("train/loss") == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]
    assert [(m.step, m.value) for m in client.get_metric_history(tr.run_id, "rollout/return")] == [
        (0, 0.0), (1, 1.0), (2, 2.0)]
    # read back through MLflow: NaN comes back as NaN at every step; the SQL store clamps +-inf to +-float max
    bad = client.get_metric_history(tr.run_id, "train/bad")
    assert sorted(m.step for m in bad) == [0, 1, 2] and all(math.isnan(m.value) for m in bad)
    assert [m.value for m in client.get_metric_history(tr.run_id, "train/inf")] == [sys.float_info.max]
    assert [m.value for m in client.get_metric_history(tr.run_id, "train/ninf")] == [-sys.float_info.max]

    # artifacts land beside the db, not in the cwd
    f = tmp_path / "perf.txt"
    f.write_text("fast")
    tr.log_artifact(f, artifact_path="perf")
    tr.log_text("a: 1\n", "config.yaml")
    art_root = Path(uri[len("sqlite:///"):]).parent / "mlartifacts"
    assert (art_root / tr.run_id / "artifacts" / "perf" / "perf.txt").read_text() == "fast"
    assert (art_root / tr.run_id / "artifacts" / "config.yaml").read_text() == "a: 1\n"
    assert not Path("mlruns").exists() or not any(Path("mlruns").glob(f"*/{tr.run_id}"))

    tr.set_terminated("FINISHED")
    assert client.get_run(tr.run_id).info.status == "FINISHED"
    with pytest.raises(ValueError, match="status must be one of"):
        tr.set_terminated("DONE")


def test_resume_same_run(uri):
    first = Tracker(uri=uri, experiment="exp-b")
    first.log_params({"algo.lr": "0.001", "seed": 1})
    first.log_metrics({"train/loss": 2.0}, step=0)
    first.set_terminated("KILLED")

    resumed = Tracker(uri=uri, experiment="exp-b", run_id=first.run_id)
    assert resumed.run_id == first.run_id
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(first.run_id).info.status == "RUNNING"
    assert resumed.log_params({"algo.lr": "0.001", "seed": 1, "new.key": "v"}) == 1  # same values skipped
    resumed.log_metrics({"train/loss": 1.0}, step=1)
    assert resumed.get_metric_history("train/loss") == [(0, 2.0), (1, 1.0)]
    exp = client.get_experiment_by_name("exp-b")
    assert len(client.search_runs([exp.experiment_id])) == 1
    with pytest.raises(ValueError, match="'algo.lr'.*0.001.*0.002"):
        resumed.log_params({"algo.lr": "0.002"})
    with pytest.raises(ValueError, match="belongs to experiment"):
        Tracker(uri=uri, experiment="exp-other", run_id=first.run_id)


def _hist(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_fork_keeps_one_timeline(uri):
    """A rollback to step 2 after steps 1..4 were logged: the new run holds steps <= 2 of the old one, then the
    redone steps; the old run is soft-deleted (hidden from search_runs), tagged with its successor."""
    from mlflow.entities import ViewType
    client = MlflowClient(tracking_uri=uri)
    tr = Tracker(uri=uri, experiment="exp-fork", run_name="run-x")
    tr.log_params({"a": 1})
    for s in range(1, 5):
        tr.log_metrics({"train/loss": float(s), **({"eval/s": 10.0 * s} if s % 2 == 0 else {})}, step=s)
    old = tr.run_id
    new = tr.fork(2)
    assert new != old == client.get_run(new).data.tags["dagrl.previous_run"]
    for s in (3, 4):
        tr.log_metrics({"train/loss": 100.0 + s, **({"eval/s": 1000.0} if s % 2 == 0 else {})}, step=s)
    assert _hist(client, new, "train/loss") == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    assert _hist(client, new, "eval/s") == [(2, 20.0), (4, 1000.0)]
    assert client.get_run(new).data.params == {"a": "1"}
    gone = client.get_run(old)
    assert gone.info.lifecycle_stage == "deleted" and gone.data.tags["dagrl.superseded_by"] == new
    exp = client.get_experiment_by_name("exp-fork").experiment_id
    assert [r.info.run_id for r in client.search_runs([exp])] == [new]
    assert len(client.search_runs([exp], run_view_type=ViewType.ALL)) == 2


def test_continue_from_a_checkpoints_run_supersedes_every_run_of_that_dagrl_run(uri):
    """Resume twice from the same step-2 checkpoint (recorded MLflow run A): the second resume copies from A and
    also supersedes the first resume's run B, so exactly one active run holds the timeline."""
    client = MlflowClient(tracking_uri=uri)
    a = Tracker(uri=uri, experiment="exp-cont", run_name="run-y")
    for s in range(1, 4):
        a.log_metrics({"m": float(s)}, step=s)
    b = Tracker(uri=uri, experiment="exp-cont", run_name="run-y")
    assert b.continue_from(a.run_id, 2) == 2
    b.log_metrics({"m": 30.0}, step=3)
    c = Tracker(uri=uri, experiment="exp-cont", run_name="run-y")
    c.continue_from(a.run_id, 2)
    c.log_metrics({"m": 300.0}, step=3)
    exp = client.get_experiment_by_name("exp-cont").experiment_id
    active = client.search_runs([exp])
    assert [r.info.run_id for r in active] == [c.run_id]
    assert _hist(client, c.run_id, "m") == [(1, 1.0), (2, 2.0), (3, 300.0)]
    assert client.get_run(b.run_id).data.tags["dagrl.superseded_by"] == c.run_id


def _open_tracker_at_barrier(uri, barrier, name, errors):
    barrier.wait()  # every process touches the new store at the same instant
    try:
        Tracker(uri=uri, experiment="race", run_name=name).set_terminated()
    except Exception as exc:  # reported to the parent; the test names the error
        errors.put(f"{name}: {type(exc).__name__}: {exc}"[:300])


def test_runs_started_at_once_on_a_new_sqlite_store_all_open(tmp_path):
    """MLflow migrates a new sqlite store's schema on first use without a lock; without Tracker's lock, runs
    started together on a new `tracking.uri` died with `duplicate column name: step` (seen with two
    `python -m pipelines.run` started in the same second). All of them must start, each with its own run."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    uri = f"sqlite:///{tmp_path}/new/mlflow.db"
    n = 2  # two suffice for the race (each process imports MLflow and migrates: ~5 s of CPU)
    barrier, errors = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_open_tracker_at_barrier, args=(uri, barrier, f"r{i}", errors)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    failed = []
    while not errors.empty():
        failed.append(errors.get())
    assert failed == [] and [p.exitcode for p in procs] == [0] * n, failed
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("race").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"r{i}" for i in range(n)]


def test_a_new_sqlite_store_interrupted_while_created_leaves_nothing_half_made(tmp_path, monkeypatch):
    """A Ctrl-C while MLflow builds a new store's schema left a half-migrated file that failed every later run
    (`table _alembic_tmp_trace_tags already exists`); the schema is now built beside the file and renamed in."""
    import os

    real, calls = os.replace, []

    def interrupted(src, dst):  # the schema is built in the temporary file; the Ctrl-C lands before the rename
        calls.append(str(src))
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    uri = default_tracking_uri(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        Tracker(uri=uri, experiment="e", run_name="r0")
    assert calls and ".creating-" in calls[0]
    assert not (tmp_path / "mlflow.db").exists()
    assert [p.name for p in tmp_path.iterdir() if "creating" in p.name] == []
    monkeypatch.setattr(os, "replace", real)
    t = Tracker(uri=uri, experiment="e", run_name="r1")  # the next run creates the store and logs
    t.log_metrics({"m": 1.0}, step=1)
    assert t.get_metric_history("m") == [(1, 1.0)]


def test_a_sqlite_store_with_a_half_done_migration_is_refused_offline(tmp_path):
    import sqlite3

    from storage.tracking import check_tracking_uri
    db = tmp_path / "mlflow.db"
    uri = default_tracking_uri(tmp_path)
    Tracker(uri=uri, experiment="e", run_name="r")
    check_tracking_uri(uri)  # a complete store passes
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE _alembic_tmp_trace_tags (key VARCHAR(250))")
    con.commit()
    con.close()
    with pytest.raises(ValueError, match=r"_alembic_tmp_trace_tags.*interrupted.*move it aside") as e:
        check_tracking_uri(uri)
    assert str(db) in str(e.value)


def _older_schema_store(db: Path) -> str:
    """A genuine store of the MLflow release before this environment's (the schema one migration before the head),
    built as MLflow builds a new store (its initial tables, then its alembic migrations, here stopped one short).
    Returns that older revision."""
    import sqlalchemy
    from alembic import command
    from mlflow.store.db.utils import _get_alembic_config
    from mlflow.store.tracking.dbmodels.initial_models import Base as InitialBase

    from storage.tracking import _mlflow_migrations
    script = _mlflow_migrations()
    older = script.get_revision(script.get_current_head()).down_revision
    cfg = _get_alembic_config(f"sqlite:///{db}")
    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    InitialBase.metadata.create_all(engine)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, older)
    engine.dispose()
    return older


def test_an_older_mlflow_schema_is_refused_offline_with_the_upgrade_that_fixes_it(tmp_path):
    """MLflow refuses a store of an older schema with a traceback when the run opens its Tracker (after the cluster
    started); the pre-flight names the file and the command, and that command makes the store usable."""
    import mlflow.store.db.utils as dbutils
    import sqlalchemy

    from storage.tracking import check_tracking_uri
    db = tmp_path / "mlflow.db"
    older = _older_schema_store(db)
    uri = f"sqlite:///{db}"
    with pytest.raises(ValueError, match=rf"{db}.*older MLflow.*{older}.*db upgrade sqlite:///{db}"):
        check_tracking_uri(uri)
    engine = sqlalchemy.create_engine(uri)
    dbutils._upgrade_db(engine)  # what the named `mlflow db upgrade` runs
    engine.dispose()
    check_tracking_uri(uri)
    t = Tracker(uri=uri, experiment="e", run_name="r")
    t.log_metrics({"m": 2.0}, step=1)
    assert t.get_metric_history("m") == [(1, 2.0)]


@pytest.mark.parametrize("kind", ["newer_mlflow", "not_sqlite", "another_programs_db"])
def test_a_file_mlflow_cannot_use_as_its_store_is_refused_offline_and_left_as_it_was(tmp_path, uri, kind):
    """Each of these fails inside MLflow after the cluster started (a newer schema: MLflow's advice to upgrade
    cannot downgrade it; another program's sqlite file: MLflow would add its tables into it). Refused offline with
    the file named; the file is not touched."""
    import shutil
    import sqlite3

    from storage.tracking import check_tracking_uri
    db = tmp_path / "mlflow.db"
    if kind == "newer_mlflow":
        Tracker(uri=uri, experiment="e", run_name="r")  # the module's store: complete, this MLflow's schema
        shutil.copy(uri[len("sqlite:///"):], db)
        con = sqlite3.connect(db)
        con.execute("UPDATE alembic_version SET version_num = 'f0f0f0f0f0f0'")  # a revision this MLflow lacks
        con.commit()
        con.close()
        words = ["newer MLflow", "f0f0f0f0f0f0", "another store"]
    elif kind == "not_sqlite":
        db.write_text("episode,return\n0,1.5\n")
        words = ["not an MLflow sqlite store"]
    else:
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE demos (episode INTEGER, ret REAL)")
        con.commit()
        con.close()
        words = ["holds tables (demos)", "no MLflow schema"]
    before = db.read_bytes()
    with pytest.raises(ValueError) as e:
        check_tracking_uri(f"sqlite:///{db}")
    for w in [str(db), *words]:
        assert w in str(e.value), (w, str(e.value))
    assert db.read_bytes() == before


def test_an_empty_file_becomes_a_store(tmp_path, monkeypatch):
    """A 0-byte file is an empty sqlite database: accepted, and built like a new store (beside it, renamed in)."""
    import os

    from storage.tracking import check_tracking_uri
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    uri = f"sqlite:///{db}"
    check_tracking_uri(uri)
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append((Path(src).name, Path(dst))),
                                                         real_replace(src, dst)))
    t = Tracker(uri=uri, experiment="e", run_name="r")
    t.log_metrics({"m": 3.0}, step=4)
    assert t.get_metric_history("m") == [(4, 3.0)]
    assert [dst for _, dst in renamed] == [db] and renamed[0][0].startswith("mlflow.db.creating-")


def test_logged_infinities_read_back_as_infinities(uri):
    """MLflow's SQL store saves +-inf as +-float max; every reading place maps them back (storage.tracking.
    metric_value), NaN stays NaN, ordinary values (the largest finite doubles below float max included) unchanged."""
    from storage.tracking import metric_history, metric_value
    big = sys.float_info.max
    assert metric_value(big) == math.inf and metric_value(-big) == -math.inf
    assert metric_value(math.inf) == math.inf and metric_value(-math.inf) == -math.inf
    assert math.isnan(metric_value(math.nan))
    below = math.nextafter(big, 0.0)
    assert metric_value(below) == below and metric_value(-1e308) == -1e308 and metric_value(0.25) == 0.25
    tr = Tracker(uri=uri, experiment="exp-inf", run_name="diverged")
    tr.log_metrics({"train/loss": -math.inf, "train/kl": math.nan}, step=1)
    tr.log_metrics({"train/loss": math.inf}, step=2)
    tr.log_metrics({"train/loss": 0.5}, step=3)
    raw = [m.value for m in MlflowClient(tracking_uri=uri).get_metric_history(tr.run_id, "train/loss")]
    assert sorted(raw) == [-big, 0.5, big]  # the store's own representation
    assert tr.get_metric_history("train/loss") == [(1, -math.inf), (2, math.inf), (3, 0.5)]
    assert [(s, v) for s, v, _ in metric_history(tr.client, tr.run_id, "train/loss")] == \
        [(1, -math.inf), (2, math.inf), (3, 0.5)]
    assert math.isnan(tr.get_metric_history("train/kl")[0][1])


def test_a_store_removed_between_the_check_and_the_write_is_one_line_and_no_traceback(tmp_path, caplog):
    """The local sqlite store vanishes after `_check_store` passed (the race the check cannot close): the write's
    failure is raised as the one-line RunDirGone naming the store, MLflow's own ERROR record of the database error
    (a ~90-line SQLAlchemy traceback on the console) is dropped, and the store file is not left re-created."""
    import logging
    from storage.rundir import RunDirGone
    from storage.tracking import Tracker
    db = tmp_path / "mlflow.db"
    tr = Tracker(uri=f"sqlite:///{db}", experiment="e", run_name="r")
    tr.log_metrics({"a": 1.0}, 1)
    db.rename(tmp_path / "moved.db")
    tr._check_store = lambda: None  # the check passed just before the removal
    caplog.set_level(logging.INFO, logger="mlflow.store.db.utils")
    with pytest.raises(RunDirGone, match=r"the MLflow store .*mlflow\.db .* was removed while the run trained"):
        tr.log_metrics({"a": 2.0}, 2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage()[:80] for r in caplog.records]
