"""Pre-flight of where a run writes: a bad `tracking.uri` or an unwritable `run_root` (and
`pipelines.record`'s output directory) ends `pipelines.run` / `pipelines.record` with one line
`error: KEY='VALUE': why; fix` and exit 2 BEFORE any cluster starts (`pipelines.clusters.start_cluster` is replaced by
a function that fails the test) and before anything is written under `run_root`."""
from __future__ import annotations

import http.server
import os
import socket
import threading

import pytest

from pipelines import record, run


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if anything starts a cluster (`pipelines.cli.with_cluster` imports `start_cluster` from
    `pipelines.clusters` when it is called)."""
    import pipelines.clusters
    started = []

    def refuse(cfg):
        started.append(cfg)
        raise AssertionError("a cluster was started")
    monkeypatch.setattr(pipelines.clusters, "start_cluster", refuse)
    return started


def _free_port() -> int:
    """A port nothing listens on: bound, then released."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _err_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _run(capsys, *argv) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = run.main(["conf=smoke", *argv])
    return rc, _err_lines(capsys)


@pytest.fixture
def a_file(tmp_path):
    """A regular file: a path under it can never be a directory (holds for root too, unlike permissions)."""
    f = tmp_path / "a_file"
    f.write_text("not a directory")
    return f


def _assert_one_line(rc, err, key, value, *words):
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {key}={value!r}: "), err
    for w in words:
        assert w in err[0], (w, err)


def test_unreachable_tracking_server(tmp_path, capsys, no_cluster):
    uri = f"http://127.0.0.1:{_free_port()}"
    rc, err = _run(capsys, f"run_root={tmp_path / 'runs'}", f"tracking.uri={uri}", "tracking.wait_s=0")  # one try
    _assert_one_line(rc, err, "tracking.uri", uri, f"{uri}/health", "mlflow server")  # why and the fix
    assert no_cluster == [] and not (tmp_path / "runs").exists()
    # with a wait (a server still starting): one line saying it waits and for how long, then the error naming
    # the bound and the key that sets it (tests/storage/test_tracking_hints.py: the wait itself)
    rc, err = _run(capsys, f"run_root={tmp_path / 'runs'}", f"tracking.uri={uri}", "tracking.wait_s=1")
    assert err[0] == f"dagrl: waiting for the MLflow server at {uri}/health (up to 1 s: tracking.wait_s)"
    _assert_one_line(rc, err[1:], "tracking.uri", uri, "within 1 s (tracking.wait_s", "raise tracking.wait_s")


def test_an_http_server_that_is_not_mlflow(tmp_path, capsys, no_cluster):
    """A server that answers, but 404 on /health (not an MLflow tracking server): refused, with the status."""
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server hook name
            self.send_error(404)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        rc, err = _run(capsys, f"run_root={tmp_path}", f"tracking.uri={uri}")
    finally:
        server.shutdown()
        server.server_close()
    _assert_one_line(rc, err, "tracking.uri", uri, "HTTP 404")
    assert no_cluster == []


def test_unknown_scheme(tmp_path, capsys, no_cluster):
    rc, err = _run(capsys, f"run_root={tmp_path}", "tracking.uri=mlfow://127.0.0.1:5000")
    _assert_one_line(rc, err, "tracking.uri", "mlfow://127.0.0.1:5000", "unknown scheme 'mlfow'", "http://")
    assert no_cluster == []


def test_sqlite_store_that_cannot_be_created(tmp_path, a_file, capsys, no_cluster):
    uri = f"sqlite:///{a_file}/sub/mlflow.db"
    rc, err = _run(capsys, f"run_root={tmp_path / 'runs'}", f"tracking.uri={uri}")
    _assert_one_line(rc, err, "tracking.uri", uri, "not a directory")
    assert no_cluster == [] and not (tmp_path / "runs").exists()


def test_the_default_store_under_run_root_is_checked(tmp_path, capsys, no_cluster):
    """Without tracking.uri the run logs to `run_root/mlflow.db`: a file there MLflow cannot use (here a half-done
    migration's leftover table; storage.tracking tests every kind) is reported under `run_root` before any
    cluster, not as MLflow's traceback when the Tracker opens."""
    import sqlite3
    root = tmp_path / "runs"
    root.mkdir()
    con = sqlite3.connect(root / "mlflow.db")
    con.execute("CREATE TABLE _alembic_tmp_trace_tags (key VARCHAR(250))")
    con.commit()
    con.close()
    rc, err = _run(capsys, f"run_root={root}")
    _assert_one_line(rc, err, "run_root", str(root), str(root / "mlflow.db"), "_alembic_tmp_trace_tags")
    assert no_cluster == [] and sorted(p.name for p in root.iterdir()) == ["mlflow.db"]


def test_run_root_under_a_file(a_file, capsys, no_cluster):
    root = f"{a_file}/runs"
    rc, err = _run(capsys, f"run_root={root}")
    _assert_one_line(rc, err, "run_root", root, "not a directory")
    assert no_cluster == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only-mode directory anyway")
def test_run_root_in_a_read_only_directory(tmp_path, capsys, no_cluster):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        rc, err = _run(capsys, f"run_root={ro / 'runs'}")
    finally:
        ro.chmod(0o755)
    _assert_one_line(rc, err, "run_root", str(ro / "runs"), "cannot create files")
    assert no_cluster == []


def test_checks_come_before_a_resume_reads_the_tracking_store(tmp_path, capsys, no_cluster, monkeypatch):
    """`runner.resume` reads the resumed run's params from the tracking store: an unreachable server must be
    reported by the pre-flight, not by MLflow's client after its retries."""
    import pipelines.runner.setup as setup

    def must_not_run(cfg):
        raise AssertionError("resolve_resume ran before the pre-flight")
    monkeypatch.setattr(setup, "resolve_resume", must_not_run)
    uri = f"http://127.0.0.1:{_free_port()}"
    rc, err = _run(capsys, f"run_root={tmp_path}", f"tracking.uri={uri}", "runner.resume=latest",
                   "tracking.wait_s=0")
    _assert_one_line(rc, err, "tracking.uri", uri, "/health")


def test_good_settings_pass(tmp_path):
    """The same checks accept what a run uses: a new run_root, the default sqlite store, an existing db file."""
    from pipelines.cli import preflight
    from pipelines.config import load_config
    from storage.tracking import check_tracking_uri, default_tracking_uri
    cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path / 'new' / 'runs'}"])
    assert preflight(cfg)
    assert not (tmp_path / "new").exists()  # probing creates nothing that stays
    db = tmp_path / "mlflow.db"
    db.write_bytes(b"")
    check_tracking_uri(f"sqlite:///{db}")
    check_tracking_uri(default_tracking_uri(tmp_path / "fresh"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


def test_record_output_directory_is_checked_before_the_cluster(tmp_path, a_file, capsys, no_cluster):
    """`pipelines.record` checks the directory its store goes to (`record.out`'s parent) the same way."""
    from dataclasses import asdict

    from pipelines.config import load_config, to_yaml
    from pipelines.runner.setup import RunState
    from storage.checkpoints import save_checkpoint
    from storage.rundir import new_run_dir, write_resolved_config
    teacher_cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}"])  # a state mlp PushCube run
    state = RunState(run_id="20260101-000000-beef", step=1, cursors=[None] * teacher_cfg.env.num_shards)
    teacher = new_run_dir(tmp_path, "smoke", state.run_id)
    write_resolved_config(teacher, to_yaml(teacher_cfg))
    save_checkpoint(teacher, 1, {"run": {"runner": asdict(state), "experiment": "smoke"}})
    out = f"{a_file}/demos/out.zarr"
    capsys.readouterr()
    rc = record.main(["conf=pushcube_record", f"run_root={tmp_path}", f"record.teacher={teacher}",
                      f"record.out={out}"])
    err = _err_lines(capsys)
    _assert_one_line(rc, err, "record.out", out, f"{a_file}/demos", "not a directory")
    assert no_cluster == []


def test_a_damaged_teacher_checkpoint_is_refused_before_the_cluster(tmp_path, capsys, no_cluster):
    """A teacher whose policy file no longer matches its checkpoint's index (sha256) was found on a worker after
    the cluster started (a traceback, a leftover `.partial` store): now by record's offline check (validate too)."""
    from dataclasses import asdict

    import torch

    from pipelines import validate
    from pipelines.config import load_config, to_yaml
    from pipelines.runner.setup import RunState
    from storage.checkpoints import save_checkpoint
    from storage.rundir import new_run_dir, write_resolved_config
    teacher_cfg, _ = load_config(["conf=smoke", f"run_root={tmp_path}"])
    state = RunState(run_id="20260101-000000-beef", step=1, cursors=[None] * teacher_cfg.env.num_shards)
    teacher = new_run_dir(tmp_path, "smoke", state.run_id)
    write_resolved_config(teacher, to_yaml(teacher_cfg))
    ckpt = save_checkpoint(teacher, 1, {"run": {"runner": asdict(state), "experiment": "smoke"},
                                        "policy": {"w": torch.ones(64)}})
    f = ckpt / "policy.pt"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    out = tmp_path / "demos" / "out.zarr"
    args = ["conf=pushcube_record", f"run_root={tmp_path}", f"record.teacher={teacher}", f"record.out={out}"]
    capsys.readouterr()
    for main in (record.main, validate.main):
        rc = main(args)
        err = _err_lines(capsys)
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: record.teacher="), err
        assert "policy.pt is corrupt" in err[0], err
    assert no_cluster == [] and not (tmp_path / "demos").exists()
