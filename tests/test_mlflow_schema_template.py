"""tests/conftest.py's MLflow schema template: a store whose schema was copied from the session's kept one is the
store MLflow builds (the same tables, indexes, rows and alembic revision, the Default experiment at the new store's
own artifact location), MLflow's two INFO lines are logged as for a built one, and a test marked
`real_mlflow_schema` gets MLflow's own build."""
from __future__ import annotations

import logging
import re
import sqlite3

import mlflow.store.db.utils as dbutils  # imported before the tests: the template is in use from the first one
import pytest

from storage.tracking import Tracker


def _dump(root) -> list[str]:
    """The store `root/mlflow.db` as SQL lines, with what two stores made apart differ in by design masked: their
    directory, run ids, times in ms since the epoch."""
    con = sqlite3.connect(root / "mlflow.db")
    try:
        text = "\n".join(con.iterdump())
    finally:
        con.close()
    text = text.replace(str(root), "<root>")
    text = re.sub(r"\b[0-9a-f]{32}\b", "<id>", text)
    return re.sub(r"\b1[0-9]{12}\b", "<ms>", text).splitlines()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store whose schema MLflow built (a module fixture: set up before the per-test template fixture)."""
    assert dbutils._initialize_tables.__module__ == "mlflow.store.db.utils"
    root = tmp_path_factory.mktemp("built")
    Tracker(uri=f"sqlite:///{root}/mlflow.db", experiment="e", run_name="r").set_terminated()
    return root


def test_a_store_from_the_template_is_the_store_mlflow_builds(built, tmp_path):
    assert dbutils._initialize_tables.__module__ != "mlflow.store.db.utils"  # the template, in this test
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("mlflow.store.db.utils")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        Tracker(uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="e", run_name="r").set_terminated()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    assert lines[:2] == ["Creating initial MLflow database tables...", "Updating database tables"], lines
    copied, made = _dump(tmp_path), _dump(built)
    assert any("alembic_version" in line for line in made)
    assert any("<root>/mlartifacts" in line and "INSERT INTO \"experiments\"" in line for line in copied)
    # as multisets of lines: two builds by MLflow itself, in one process, order some constraints and indexes apart
    assert sorted(copied) == sorted(made)


@pytest.mark.real_mlflow_schema
def test_a_marked_test_builds_the_schema_with_mlflows_migrations():
    assert dbutils._initialize_tables.__module__ == "mlflow.store.db.utils"
