"""MLflow tracking through ``MlflowClient`` only (no global ``mlflow.start_run`` state).

URI convention: a run directory root ``<path>`` holds ``<path>/mlflow.db`` (tracking uri
``sqlite:///<abs path>/mlflow.db``, see :func:`default_tracking_uri`) and the artifacts in ``<path>/mlartifacts``:
for ``sqlite:///`` uris the experiment is created with ``artifact_location`` beside the database, so artifacts
never land in the current working directory. Other uris (``http://host:port`` servers) keep the server's default.

Metrics are logged with one ``log_batch`` call per 1000 values (a plain ``log_metric`` costs 20-40 ms per call).
Prefixes used by dagrl: ``train/ rollout/ env/ eval/ time/ system/``.

One timeline per run (resume, rollback): MLflow's public client cannot delete single metric points, and a step
that is redone (a resume from a checkpoint at step k, a rollback after a lost actor) would otherwise log a second
value at every step > k. :meth:`Tracker.fork` therefore starts a NEW MLflow run (same run name, tag
``dagrl.run_id``), copies every point with step <= k (original timestamps; params too, except on a resume, whose
params are logged afresh), links the two (``dagrl.previous_run`` on the new run, ``dagrl.superseded_by`` and
``dagrl.superseded_at_step`` on the old one) and soft-deletes the superseded runs (``MlflowClient.delete_run``:
hidden from the UI and from ``search_runs`` by default, restorable with ``restore_run``, their points kept). Every
active run therefore holds exactly one value per step per key.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus, RunTag, ViewType

# MLflow's sqlite store configures its SQLAlchemy mappers with the deprecated `noload` strategy: SQLAlchemy 2.x warns
# once per process on stderr (two lines in every run's output) about MLflow's code, which no user of dagrl can act on
warnings.filterwarnings("ignore", message=r"The ``noload`` loader strategy is deprecated", module=r"mlflow\.")

MAX_PARAM_VALUE_LENGTH = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
_STATUSES = ("FINISHED", "FAILED", "KILLED")
RUN_ID_TAG = "dagrl.run_id"  # the dagrl run id (run dir name) every MLflow run of that dagrl run carries
PREVIOUS_TAG = "dagrl.previous_run"
SUPERSEDED_TAG = "dagrl.superseded_by"
SWEEP_TAG = "dagrl.sweep"  # the sweep id of a run started by `pipelines.run -m` (pipelines.sweep)
SWEPT_TAG_PREFIX = "dagrl.swept."  # + a swept key: the value this run was given (`dagrl.swept.algorithm.lr`)
CARRIED_TAG_PREFIXES = (SWEEP_TAG, SWEPT_TAG_PREFIX)  # tags a resume or rollback copies into its new MLflow run


def default_tracking_uri(path: str | Path) -> str:
    """``sqlite:///<abs path>/mlflow.db`` for a directory ``path``."""
    return f"sqlite:///{Path(path).resolve() / 'mlflow.db'}"


def _sqlite_path(uri: str) -> Path | None:
    """The database file a ``sqlite:///`` tracking uri names (query parameters dropped), else None."""
    prefix = "sqlite:///"
    return Path(uri[len(prefix):].split("?", 1)[0]) if uri.startswith(prefix) else None


def _file_identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of `path`, None when it is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _sqlite_db(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking uri (its folder created), else None."""
    db = _sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    return db


def _sqlite_artifact_location(uri: str) -> str | None:
    """``<db dir>/mlartifacts`` as a file uri for ``sqlite:///`` tracking uris, else None."""
    db = _sqlite_db(uri)
    return None if db is None else (db.resolve().parent / "mlartifacts").as_uri()


@contextlib.contextmanager
def _store_init_lock(uri: str):
    """For ``sqlite:///`` uris, an exclusive ``fcntl`` lock on ``<db>.lock`` while held; a no-op otherwise.

    MLflow creates and migrates a new sqlite database's schema when a process first touches it, without a lock:
    two runs started at the same instant on a new store both migrate it and the second one dies
    (``sqlite3.OperationalError: duplicate column name: step``). Holding this lock around the first use makes
    the second process wait and find the schema complete."""
    db = _sqlite_db(uri)
    if db is None:
        yield
        return
    import fcntl
    with open(db.with_name(db.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            if not db.exists() or db.stat().st_size == 0:  # an empty file is an empty sqlite database
                _create_sqlite_store(db)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _create_sqlite_store(db: Path) -> None:
    """Create a new MLflow sqlite store at `db` atomically: MLflow's schema (~40 alembic migrations, ~1-2 s) is
    built in `<db>.creating-<pid>` beside it, which then replaces `db` in one rename.

    Why: MLflow migrates a new database in place, and a Ctrl-C during that (measured 2026-12-05: a SIGINT 0.8 s
    after `dagrl: experiment`, the machine under load) left `_alembic_tmp_trace_tags` in the file, after which every
    later run on that store died with `table _alembic_tmp_trace_tags already exists`. Now an interrupted creation
    leaves no `db` (the next run creates it again); the temporary file is removed on the way out (a process killed
    outright leaves it beside the store, unused)."""
    import os

    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    tmp = db.with_name(f"{db.name}.creating-{os.getpid()}")
    try:
        store = SqlAlchemyStore(f"sqlite:///{tmp}", _sqlite_artifact_location(f"sqlite:///{db}"))
        store.engine.dispose()
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)


MIGRATION_LEFTOVER = "_alembic_tmp_"  # alembic's batch tables on sqlite, dropped when a migration completes


def _mlflow_migrations():
    """MLflow's own alembic migration scripts (`mlflow/store/db_migrations`, an `alembic.script.ScriptDirectory`):
    its head is the schema revision the installed MLflow expects of a store, as MLflow's `_verify_schema` reads it."""
    import importlib.util

    from alembic.script import ScriptDirectory
    return ScriptDirectory(str(Path(importlib.util.find_spec("mlflow").origin).parent / "store" / "db_migrations"))


def _sqlite_store_problem(db: Path) -> str | None:
    """Why the existing sqlite file `db` cannot serve as this MLflow's tracking store, with the fix (one line), or
    None when it can (a complete store of the installed MLflow's schema, or an empty file).

    Refused, each of which MLflow itself turns into a traceback after the cluster started, or worse:
    - not an sqlite database (MLflow: `file is not a database`);
    - an interrupted schema migration (an ``_alembic_tmp_*`` table; MLflow: `table ... already exists` on every run);
    - tables but no MLflow schema (another program's database: MLflow would add its ~30 tables into it);
    - a schema of an older MLflow (MLflow: `Detected out-of-date database schema`) or of a newer one (the same
      message, whose advice `mlflow db upgrade` cannot downgrade)."""
    import sqlite3
    try:
        con = sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            rev = (con.execute("SELECT version_num FROM alembic_version").fetchone() or [None])[0] \
                if "alembic_version" in tables else None
        finally:
            con.close()
    except sqlite3.Error as exc:
        return (f"the file {db} is not an MLflow sqlite store ({exc}); point tracking.uri (or run_root) at another "
                f"file, or move it aside")
    leftover = next((t for t in tables if t.startswith(MIGRATION_LEFTOVER)), None)
    if leftover is not None:
        return (f"the MLflow database {db} holds table {leftover!r}: a schema migration of it was interrupted, and "
                f"MLflow fails on it; if it holds no runs you need, move it aside (the next run creates a new one), "
                f"else back it up and drop that table (sqlite3 {db} 'DROP TABLE {leftover}')")
    if not tables:
        return None  # an empty database: MLflow builds its schema in it
    if rev is None:
        shown = ", ".join(sorted(tables)[:3]) + (", ..." if len(tables) > 3 else "")
        return (f"the sqlite file {db} holds tables ({shown}) but no MLflow schema: another program's database; "
                f"point tracking.uri (or run_root) elsewhere")
    script = _mlflow_migrations()
    head = script.get_current_head()
    if rev == head:
        return None
    import mlflow
    from alembic.util import CommandError
    try:
        older = script.get_revision(rev) is not None  # one of this MLflow's migrations
    except CommandError:
        older = False
    if older:
        return (f"the MLflow database {db} has the schema of an older MLflow (revision {rev}; this environment's "
                f"MLflow {mlflow.__version__} expects {head}); back it up, then migrate it: "
                f"{Path(sys.executable).parent / 'mlflow'} db upgrade sqlite:///{db}")
    return (f"the MLflow database {db} was written by a newer MLflow than this environment's {mlflow.__version__} "
            f"(schema revision {rev} is unknown to it, and MLflow cannot downgrade a store); read it with that "
            f"MLflow, or log to another store (run_root=DIR or tracking.uri=sqlite:////path/other.db)")


def _plain(value: Any) -> Any:
    """Mappings/sequences (incl. OmegaConf containers) -> plain dicts/lists for a JSON repr."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(v) for v in value]
    return value


PARAM_KEY_COMMA = "/"  # a "," inside a config key (cluster.component_placement's "actor,env,rollout") in a param name
PARAM_PART = ".__part"  # a value longer than MAX_PARAM_VALUE_LENGTH continues in `<name>.__part2`, `.__part3`, ...
MAX_PARAM_NAME_LENGTH = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH


def param_name(path: Sequence[str], sep: str = ".") -> str:
    """The MLflow param name of a config key given as its segments: segments joined by `sep`, a "," inside a
    segment written as "/" (MLflow names allow alphanumerics, "_", "-", ".", " ", ":" and "/" only; config keys
    never hold "/", so the mapping is reversible: `config_key`). A dict key holding "." (a module path in
    `algorithm.lr_scale`) stays as it is: its name reads like one more level of nesting.

    Raises:
        ValueError: a segment with a character MLflow does not allow even after the mapping, or holding "/" or
            `sep`, or a name longer than MLflow's 250 characters (no valid dagrl config has one).
    """
    import re
    parts = []
    for seg in map(str, path):
        if PARAM_KEY_COMMA in seg or not re.fullmatch(r"[\w\- ,.]+", seg) or seg.strip(".") != seg:
            raise ValueError(f"config key segment {seg!r} of {'.'.join(map(str, path))!r} cannot be an MLflow param "
                             f"name (allowed: letters, digits, '_', '-', ' ', ',', and '.' inside)")
        parts.append(seg.replace(",", PARAM_KEY_COMMA))
    name = sep.join(parts)
    if len(name) > MAX_PARAM_NAME_LENGTH:
        raise ValueError(f"param name {name[:60]!r}... is {len(name)} characters; MLflow allows {MAX_PARAM_NAME_LENGTH}")
    return name


def config_key(name: str) -> str:
    """Inverse of `param_name` for dotted keys: 'cluster.component_placement.actor/env' -> '...actor,env'."""
    return name.replace(PARAM_KEY_COMMA, ",")


def flatten_config(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, str]:
    """Nested mapping -> MLflow params ``{"a.b.c": "value"}`` that MLflow accepts for every valid config.

    Names: `param_name` (a "," in a key -> "/", reversibly). Values: ``str()``; lists/tuples as their JSON repr,
    empty mappings as ``"{}"``; a value longer than MLflow's 6000 characters is split into ``<name>`` (the first
    6000) and ``<name>.__part2``, ``<name>.__part3``, ... (`unflatten_values` joins them back).

    Raises:
        ValueError: a key MLflow cannot name (see `param_name`).
    """
    out: dict[str, str] = {}
    path0 = [p for p in prefix.split(sep)] if prefix else []
    for path, text in _leaf_items(d, path0):
        name = param_name(path, sep)
        for i in range(0, max(len(text), 1), MAX_PARAM_VALUE_LENGTH):
            out[name if i == 0 else f"{name}{PARAM_PART}{i // MAX_PARAM_VALUE_LENGTH + 1}"] = \
                text[i:i + MAX_PARAM_VALUE_LENGTH]
    return out


def _leaf_items(d: Mapping[str, Any], path: list[str]):
    for key, value in d.items():
        p = [*path, str(key)]
        if isinstance(value, Mapping):
            if len(value) == 0:
                yield p, "{}"
            else:
                yield from _leaf_items(value, p)
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            yield p, json.dumps(_plain(value), default=str)
        else:
            yield p, str(value)


def unflatten_values(params: Mapping[str, str]) -> dict[str, str]:
    """Params as logged (`flatten_config`) -> {config key: full value text}: parts joined, names mapped back
    (`config_key`)."""
    import re
    parts: dict[str, dict[int, str]] = {}
    for name, text in params.items():
        m = re.fullmatch(rf"(.*){re.escape(PARAM_PART)}(\d+)", name)
        base, i = (m.group(1), int(m.group(2))) if m else (name, 1)
        parts.setdefault(base, {})[i] = text
    return {config_key(b): "".join(v for _, v in sorted(p.items())) for b, p in parts.items()}


def metric_value(value: float) -> float:
    """A logged metric value as it was logged. MLflow's SQL store saves +-inf as +-``sys.float_info.max``
    (1.7976931348623157e308), so a diverged value would read back as a huge finite number (printed -1.798e+308,
    ranked "best" by a minimum); every value at or beyond +-float max reads back as +-inf. NaN stays NaN. The one
    mapping of values that come back from MLflow (``metric_history``, ``Tracker.get_metric_history``,
    pipelines.compare's run summaries)."""
    v = float(value)
    if v >= sys.float_info.max:
        return math.inf
    if v <= -sys.float_info.max:
        return -math.inf
    return v


def metric_history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """(step, value, timestamp in ms) of metric ``key`` of MLflow run ``run_id``, sorted by step, one point per step
    (the newest where a step was logged twice, as MLflow charts show), values through ``metric_value`` (+-inf as
    logged, not +-float max). Raises MlflowException as ``MlflowClient.get_metric_history``."""
    by_step: dict[int, tuple[int, float, int]] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
        by_step[m.step] = (m.step, metric_value(m.value), m.timestamp)
    return [by_step[s] for s in sorted(by_step)]


class _ReRaisedDbError(logging.Filter):
    """Drops the record `mlflow.store.db.utils` logs (with a full SQLAlchemy traceback, ~90 lines on the console)
    for a database error it then re-raises as an MlflowException: the caller gets that exception and reports it
    (a store removed under a run: one line, `Tracker.store_gone`); every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SQLAlchemy database error")


_DB_LOGGER = "mlflow.store.db.utils"


class Tracker:
    """One MLflow run: start a new one, or resume ``run_id`` (the same run continues)."""

    def __init__(
        self,
        *,
        uri: str,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        artifact_location: str | None = None,
    ):
        self.uri = uri
        self.experiment = experiment
        self.nonfinite_logged = 0  # NaN / inf metric values logged (log_metrics logs them as they are)
        db_log = logging.getLogger(_DB_LOGGER)
        if not any(isinstance(f, _ReRaisedDbError) for f in db_log.filters):
            db_log.addFilter(_ReRaisedDbError())
        with _store_init_lock(uri):  # the first use of a new sqlite store creates its schema
            self._client = MlflowClient(tracking_uri=uri)
            experiment_id = self._experiment_id(experiment, artifact_location or _sqlite_artifact_location(uri))
        if run_id is None:
            run = self._client.create_run(experiment_id, run_name=run_name,
                                          tags={RUN_ID_TAG: run_name} if run_name else None)
        else:
            run = self._client.get_run(run_id)  # raises MlflowException for an unknown id
            if run.info.experiment_id != experiment_id:
                raise ValueError(
                    f"run {run_id} belongs to experiment id {run.info.experiment_id}, not {experiment!r} "
                    f"(id {experiment_id}); pass the experiment the run was started in"
                )
            if run.info.lifecycle_stage != "active":
                raise ValueError(f"run {run_id} is {run.info.lifecycle_stage}; restore it in MLflow or start a new run")
            self._client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        self._run_id = run.info.run_id
        self.experiment_id = experiment_id
        db = _sqlite_path(uri)  # a local sqlite store: its file's identity, to tell when it vanishes (`store_gone`)
        self._db = (db, _file_identity(db)) if db is not None else None

    def store_gone(self) -> str | None:
        """None while the run's local sqlite store is the file it was (or the store is not a local sqlite file);
        else one line: the store was removed or replaced under the run (sqlite then fails every write with
        "attempt to write a readonly database" or "no such table", and MLflow logs each with a long traceback)."""
        if self._db is None:
            return None
        db, ident = self._db
        now = _file_identity(db)
        if now is not None and now == ident:
            return None
        what = "removed" if now is None else "removed and replaced by another file"
        return (f"the MLflow store {db} (tracking.uri {self.uri}) was {what} while the run trained; the run stopped "
                f"(its MLflow run {self._run_id} went with the store): restore the store from a copy and resume, "
                f"or start a new run")

    @contextlib.contextmanager
    def _writing(self):
        """Around one write to the store: `_check_store` before it, and a write that fails because the local store
        vanished meanwhile (between the check and the write) raised as the same one line (RunDirGone) rather than
        MLflow's error; any other failure is raised as it is."""
        self._check_store()
        try:
            yield
        except Exception:
            why = self.store_gone()
            if why is None:
                raise
            from storage.rundir import RunDirGone
            raise RunDirGone(why) from None

    def _check_store(self) -> None:
        """Raise storage.rundir.RunDirGone (`store_gone`'s line) before a write to a vanished local store."""
        why = self.store_gone()
        if why is not None:
            from storage.rundir import RunDirGone
            raise RunDirGone(why)

    def _experiment_id(self, name: str, artifact_location: str | None) -> str:
        exp = self._client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self._client.create_experiment(name, artifact_location=artifact_location)
            except Exception:  # created concurrently by another process
                exp = self._client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage != "active":
            raise ValueError(f"MLflow experiment {name!r} at {self.uri} is deleted; restore it or use another name")
        return exp.experiment_id

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def client(self) -> MlflowClient:
        return self._client

    # ---- params ----------------------------------------------------------------------------------------
    def log_params(self, flat: Mapping[str, Any]) -> int:
        """Log params (values ``str()``-ed, truncated to 6000 chars) in batches of <= 100.

        Params already logged with the same value are skipped (resume); a changed value raises ValueError.
        Returns the number of params newly logged.
        """
        existing = self._client.get_run(self._run_id).data.params
        new: list[Param] = []
        for key, value in flat.items():
            text = str(value)[:MAX_PARAM_VALUE_LENGTH]
            if key in existing:
                if existing[key] != text:
                    raise ValueError(
                        f"param {key!r} of run {self._run_id} is already {existing[key]!r}, cannot change it to "
                        f"{text!r}; MLflow params are immutable - resume with the same config or start a new run"
                    )
                continue
            new.append(Param(str(key), text))
        for i in range(0, len(new), PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=new[i:i + PARAMS_PER_BATCH])
        return len(new)

    # ---- metrics ---------------------------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> int:
        """Log all ``metrics`` at ``step`` with one ``log_batch`` per 1000 values. Returns the number logged.

        Non-finite values are logged too, never dropped (a NaN loss is a fact the charts must show): MLflow keeps
        NaN as NaN; its SQL store saves +-inf as +-1.7976931348623157e308 (``sys.float_info.max``). Each one is
        counted in ``nonfinite_logged``."""
        ts = int(time.time() * 1000)
        batch: list[Metric] = []
        for key, value in metrics.items():
            value = float(value)
            if not math.isfinite(value):
                self.nonfinite_logged += 1
            batch.append(Metric(str(key), value, ts, int(step)))
        with self._writing():
            for i in range(0, len(batch), METRICS_PER_BATCH):
                self._client.log_batch(self._run_id, metrics=batch[i:i + METRICS_PER_BATCH])
        return len(batch)

    def get_metric_history(self, key: str) -> list[tuple[int, float]]:
        """Every (step, value) logged for ``key`` in this run, by step then time; +-inf as logged (``metric_value``)."""
        history = self._client.get_metric_history(self._run_id, key)
        return [(m.step, metric_value(m.value)) for m in sorted(history, key=lambda m: (m.step, m.timestamp))]

    # ---- one timeline: fork a run at a step ----------------------------------------------------------
    def fork(self, through_step: int, *, reason: str = "rollback") -> str:
        """Continue this dagrl run in a NEW MLflow run holding only the points with step <= ``through_step``
        (a rollback to a checkpoint at that step): params and kept points copied, the current run superseded
        (see :meth:`continue_from`). This tracker then logs to the new run; returns its id."""
        old = self._run_id
        run = self._client.get_run(old)
        self._run_id = self._client.create_run(
            self.experiment_id, run_name=run.info.run_name,
            tags={RUN_ID_TAG: run.data.tags.get(RUN_ID_TAG, run.info.run_name)}).info.run_id
        self.continue_from(old, through_step, copy_params=True, reason=reason)
        return self._run_id

    def continue_from(self, source_run_id: str, through_step: int, *, copy_params: bool = False,
                      reason: str = "resume") -> int:
        """Make this (new) run the continuation of ``source_run_id`` up to ``through_step``.

        Args:
            source_run_id: the run to copy points from, e.g. the MLflow run a checkpoint recorded; it may be
                deleted (superseded) already.
            through_step: the last training step kept (a checkpoint's step; 0 keeps only a step-0 eval).
            copy_params: also copy the source's params (a rollback); a resume logs its own.
            reason: recorded in the tag ``dagrl.fork_reason``.

        Copies every metric point of the source with step <= ``through_step`` (original timestamps), tags this run
        ``dagrl.previous_run`` = source, and supersedes every other active run of the experiment with the same
        ``dagrl.run_id`` (the source, runs an earlier resume or rollback left): tagged ``dagrl.superseded_by``,
        set KILLED if still RUNNING, soft-deleted. Returns the number of points copied.
        """
        k, new, src = int(through_step), self._run_id, source_run_id
        src_run = self._client.get_run(src)
        dagrl_id = src_run.data.tags.get(RUN_ID_TAG, src_run.info.run_name)
        tags = [RunTag(RUN_ID_TAG, dagrl_id), RunTag(PREVIOUS_TAG, src), RunTag("dagrl.fork_reason", reason),
                RunTag("dagrl.forked_at_step", str(k))]
        tags += [RunTag(key, value) for key, value in src_run.data.tags.items()  # a sweep's tags follow the run
                 if key.startswith(CARRIED_TAG_PREFIXES)]
        self._client.log_batch(new, tags=tags)
        if copy_params:
            params = [Param(key, value) for key, value in src_run.data.params.items()]
            for i in range(0, len(params), PARAMS_PER_BATCH):
                self._client.log_batch(new, params=params[i:i + PARAMS_PER_BATCH])
        points = [m for key in src_run.data.metrics for m in self._client.get_metric_history(src, key)
                  if m.step <= k]
        points.sort(key=lambda m: (m.step, m.timestamp))
        for i in range(0, len(points), METRICS_PER_BATCH):
            self._client.log_batch(new, metrics=[Metric(m.key, m.value, m.timestamp, m.step)
                                                 for m in points[i:i + METRICS_PER_BATCH]])
        doomed = {src} | {r.info.run_id for r in self._client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{dagrl_id}'",
            run_view_type=ViewType.ACTIVE_ONLY)}
        doomed.discard(new)
        for rid in sorted(doomed):
            self._supersede(rid, new, k)
        return len(points)

    def _supersede(self, run_id: str, by: str, step: int) -> None:
        run = self._client.get_run(run_id)
        if run.info.lifecycle_stage != "active":  # superseded before (MLflow refuses writes to deleted runs)
            return
        self._client.log_batch(run_id, tags=[RunTag(SUPERSEDED_TAG, by),
                                             RunTag("dagrl.superseded_at_step", str(step))])
        if run.info.status == "RUNNING":
            with _no_run_url_lines():
                self._client.set_terminated(run_id, "KILLED")
        self._client.delete_run(run_id)

    # ---- artifacts and status --------------------------------------------------------------------------
    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Log a file, or every file of a directory (under `artifact_path`)."""
        with self._writing():
            if Path(local_path).is_dir():
                self._client.log_artifacts(self._run_id, str(local_path), artifact_path)
            else:
                self._client.log_artifact(self._run_id, str(local_path), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        with self._writing():
            self._client.log_text(self._run_id, text, artifact_file)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Tag this MLflow run (values `str()`-ed), e.g. a sweep's `dagrl.sweep` / `dagrl.swept.<key>` (tags with
        a prefix of CARRIED_TAG_PREFIXES are copied into the new run of a resume or rollback: `continue_from`)."""
        if tags:
            with self._writing():
                self._client.log_batch(self._run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def set_terminated(self, status: str = "FINISHED") -> None:
        if status not in _STATUSES:
            raise ValueError(f"status must be one of {_STATUSES}, got {status!r}")
        with self._writing(), _no_run_url_lines():
            self._client.set_terminated(self._run_id, status)

    def __repr__(self) -> str:
        return f"Tracker(uri={self.uri!r}, experiment={self.experiment!r}, run_id={self._run_id!r})"


_URL_LINES_OFF = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


@contextlib.contextmanager
def _no_run_url_lines():
    """While a run is set terminated: MLflow's client prints `🏃 View run NAME at: URL` and `🧪 View experiment at:
    URL` to stdout for a run on a tracking server (`TrackingServiceClient._log_url`, mlflow 3), in the middle of
    dagrl's own lines; its variable MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT turns that off. A value the user set is
    left as it is; the run's link is in dagrl's last line instead (`view_hint`)."""
    if _URL_LINES_OFF in os.environ:
        yield
        return
    os.environ[_URL_LINES_OFF] = "true"
    try:
        yield
    finally:
        os.environ.pop(_URL_LINES_OFF, None)


def view_hint(uri: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """How to look at a run logged to `uri` (the end-of-run line's `view: ...`): for an http(s) tracking server its
    own UI, `open <uri>/#/experiments/<experiment_id>/runs/<run_id>` (the link MLflow's client prints; `mlflow ui
    --backend-store-uri http://...` fails there with UnsupportedModelRegistryStoreURIException: a server is not a
    store `mlflow ui` can serve); for databricks the workspace's UI; for a store (sqlite, file, a database)
    `mlflow ui --backend-store-uri <uri>`, which serves it on http://127.0.0.1:5000."""
    from urllib.parse import urlparse
    scheme = urlparse(uri).scheme.lower() or uri.lower()  # "databricks" alone is a uri too
    if scheme in ("http", "https"):
        link = uri.split("?", 1)[0].rstrip("/")
        if experiment_id is not None:
            link += f"/#/experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
        return f"open {link}"
    if scheme.startswith("databricks"):
        return f"open the run in the Databricks workspace of {uri}" + (f" (MLflow run {run_id})" if run_id else "")
    return f"mlflow ui --backend-store-uri {uri}"


# ---- pre-flight -------------------------------------------------------------------------------------------
TRACKING_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "mssql", "databricks")
PROBE_TIMEOUT_S = 3.0  # one request to an http(s) tracking server's /health must answer within this
# the documented way to start a tracking server (README, docker-compose.yml's `mlflow` service): without its job
# runner (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false: mlflow.server starts no `mlflow.server.jobs._job_runner`
# process; dagrl submits no MLflow jobs)
SERVER_COMMAND = ("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server --host 127.0.0.1 --port 5000 "
                  "--backend-store-uri sqlite:///mlflow.db --serve-artifacts")


def check_tracking_uri(uri: str, *, must_exist: bool = False, timeout_s: float = PROBE_TIMEOUT_S,
                       wait_s: float = 0.0, on_wait=None) -> None:
    """Pre-flight of a tracking URI, quick and before any worker starts (`pipelines.run`) or anything is read
    (`pipelines.compare`):

    - ``http(s)://host:port``: GET ``<uri>/health`` (MLflow's liveness endpoint, open even with auth) must answer
      200; a request that gets no answer (refused: nothing listening yet; no reply within ``timeout_s``: a server
      still loading) is tried again, once a second, until ``wait_s`` seconds have passed (`pipelines.cli.preflight`:
      `tracking.wait_s`; a loaded machine's `mlflow server` took 73 s to answer), with ``on_wait(line)`` called
      once after the first failed try (the caller prints it); a wrong host or port then fails within ``wait_s``,
      not after minutes of the client's retries, naming the bound; https honours MLFLOW_TRACKING_INSECURE_TLS and
      MLFLOW_TRACKING_SERVER_CERT_PATH as MLflow's client does;
    - ``sqlite:///<path>``: the database file (``must_exist``: a store to read, it must exist) or, when it does
      not exist yet, its nearest existing parent directory must be writable (probed with a temporary file); an
      existing file must be a complete store of the installed MLflow's schema, or empty (`_sqlite_store_problem`:
      not sqlite, a migration left half-done, another program's tables, an older or newer MLflow's schema are
      refused with the fix);
    - ``file:`` or a plain path (MLflow's file store): the same for the directory;
    - ``postgresql``/``mysql``/``mssql``(``+driver``) and ``databricks``: only the scheme is checked (the driver
      connects when the run starts);
    - any other scheme is refused.

    Raises:
        ValueError: one line "why; fix" (the caller prefixes the key and value).
    """
    from urllib.parse import urlparse
    scheme = urlparse(uri).scheme.lower()
    base = scheme.split("+", 1)[0]
    if len(scheme) <= 1:  # a plain path (or a Windows drive letter): MLflow's file store
        return _check_local_store(Path(uri), must_exist=must_exist, what="directory")
    if base not in TRACKING_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r} (MLflow tracking stores: {', '.join(TRACKING_SCHEMES)}); "
                         f"e.g. tracking.uri=http://127.0.0.1:5000 for a server, or leave tracking.uri unset for "
                         f"the sqlite store under run_root")
    if base in ("http", "https"):
        return _probe_http(uri, timeout_s, wait_s, on_wait)
    if base == "sqlite":
        path = _sqlite_path(uri)
        if path is None or str(path) in ("", ".", ":memory:"):
            raise ValueError("an in-memory sqlite store loses the run when it ends; name a file: "
                             "sqlite:////absolute/path/mlflow.db")
        db = path.expanduser()
        _check_local_store(db, must_exist=must_exist, what="database file")
        problem = _sqlite_store_problem(db) if db.is_file() else None
        if problem is not None:
            raise ValueError(problem)
        return None
    if base == "file":
        return _check_local_store(Path(urlparse(uri).path), must_exist=must_exist, what="directory")
    return None  # a database server or databricks: its client connects when the run starts


def _check_local_store(path: Path, *, must_exist: bool, what: str) -> None:
    """A local store (`what`: "database file" for sqlite, "directory" for the file store): readable when
    `must_exist`, else writable where it is or will be created (a temporary file probes the directory)."""
    import os
    path = path.expanduser().absolute()
    wants_dir = what == "directory"
    if must_exist:
        if not path.exists():
            raise ValueError(f"no {what} {path} (nothing was logged there); pass the store the runs were logged "
                             f"to (--tracking-uri, or --run-root DIR for sqlite:///DIR/mlflow.db)")
        if not os.access(path, os.R_OK):
            raise ValueError(f"the {what} {path} is not readable; fix its permissions")
        return
    if path.exists() and path.is_dir() != wants_dir:
        raise ValueError(f"{path} is a {'file' if wants_dir else 'directory'}, not a {what}; choose another path")
    if path.is_file():
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise ValueError(f"the {what} {path} is not writable: {exc.strerror or exc}; fix its permissions "
                             f"or choose another path") from None
        return
    from storage.rundir import check_writable_dir
    check_writable_dir(path if wants_dir else path.parent)  # the directory it will be created in


def _probe_http(uri: str, timeout_s: float, wait_s: float = 0.0, on_wait=None) -> None:
    """`check_tracking_uri` of an http(s) uri: GET <uri>/health until it answers or `wait_s` (s) have passed."""
    import urllib.error
    import urllib.request
    url = uri.split("?", 1)[0].rstrip("/") + "/health"
    fix = f"start the server (e.g. `{SERVER_COMMAND}`) or fix tracking.uri"
    context = None
    if url.startswith("https"):  # the TLS settings MLflow's client honours (a self-signed server's certificate)
        import os
        import ssl
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context = ssl._create_unverified_context()  # noqa: S323 - what the user asked MLflow for
        elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:  # noqa: S310 - http(s)
                status = resp.status
            break
        except urllib.error.HTTPError as exc:
            raise ValueError(f"{url} answered HTTP {exc.code} ({exc.reason}): not an MLflow tracking server, or "
                             f"behind a proxy that hides /health; {fix}") from None
        except (urllib.error.URLError, OSError) as exc:  # refused, unknown host, timeout: maybe still starting
            left = deadline - time.monotonic()
            if left <= 0:
                reason = getattr(exc, "reason", exc)
                if wait_s <= 0:
                    raise ValueError(f"no MLflow server answered {url} ({reason}; waited up to {timeout_s:g} s); "
                                     f"{fix}") from None
                raise ValueError(f"no MLflow server answered {url} within {wait_s:g} s (tracking.wait_s; last "
                                 f"try: {reason}); {fix}; for a server still starting (a minute on a loaded "
                                 f"machine) raise tracking.wait_s") from None
            if on_wait is not None:
                on_wait(f"waiting for the MLflow server at {url} (up to {wait_s:g} s: tracking.wait_s)")
                on_wait = None
            time.sleep(min(1.0, left))
    if status != 200:
        raise ValueError(f"{url} answered HTTP {status}, not 200; {fix}")
