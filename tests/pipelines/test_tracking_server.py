"""A real tracking server (issue 14, item 4): `conf=smoke` with `tracking.uri=http://127.0.0.1:PORT` against a local
`mlflow server` (a subprocess bound to 127.0.0.1 on a free port, a sqlite database backend, artifacts served from
a directory: `--serve-artifacts`) logs what the embedded sqlite default logs: the flattened resolved config as
params, the metrics of every step and eval, and the resolved config.yaml as an artifact that lands in the
server's artifact directory (not in the run root). Nothing is written to `run_root/mlflow.db`. A resume
(`runner.resume=latest` with one more step) continues the timeline on the server as it does in sqlite: a new MLflow
run of the same dagrl run id with every step once, linked to the superseded run (soft-deleted), the changed keys
as the artifact `resumes/step_N.yaml`."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from storage.tracking import PREVIOUS_TAG, RUN_ID_TAG, SUPERSEDED_TAG, flatten_config

START_TIMEOUT_S = 300  # an idle machine starts it in seconds; a loaded 2-core one took over a minute


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """(uri, artifact dir) of a local `mlflow server` started for this test and stopped after it (its whole
    process group: the server's uvicorn workers with it)."""
    port = _free_port()
    artifacts = tmp_path / "server_artifacts"
    log = open(tmp_path / "server.log", "wb")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job-runner process: not needed here
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--serve-artifacts",
         "--artifacts-destination", str(artifacts)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=tmp_path)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"mlflow server exited {proc.returncode}: {(tmp_path / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not up after {START_TIMEOUT_S} s: "
                            f"{(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri, artifacts
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
def test_smoke_run_against_a_local_mlflow_server(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from pipelines.config import load_config, to_dict
    from pipelines.run import main
    uri, artifacts = mlflow_server
    root = tmp_path / "runs"
    argv = ["conf=smoke", f"run_root={root}", f"tracking.uri={uri}", "cluster.dashboard_address=127.0.0.1:0"]
    assert main(argv) == 0
    assert not (root / "mlflow.db").exists() and not (root / "mlartifacts").exists()  # all of it went to the server

    client = MlflowClient(uri)
    cfg, _ = load_config(argv)
    exp = client.get_experiment_by_name(cfg.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    (run_dir,) = [p for p in (root / cfg.experiment).iterdir() if p.is_dir()]
    assert run.data.tags[RUN_ID_TAG] == run_dir.name and run.info.status == "FINISHED"
    expected = flatten_config(to_dict(cfg))
    assert {k: run.data.params.get(k) for k in expected} == expected  # the resolved config, every key
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "time/step")]
    assert sorted(steps) == list(range(1, cfg.runner.max_steps + 1))
    evals = [m.step for m in client.get_metric_history(run.info.run_id, "eval/success_once")]
    assert cfg.runner.max_steps in evals
    local = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl"))
    assert Path(local).read_text() == (run_dir / "config.yaml").read_text()
    served = list(artifacts.rglob("config.yaml"))
    assert len(served) == 1 and served[0].read_text() == (run_dir / "config.yaml").read_text()

    # resume with one more step: the same timeline continues on the server
    first = run.info.run_id
    k = cfg.runner.max_steps
    assert main([*argv, "runner.resume=latest", f"runner.max_steps={k + 1}"]) == 0
    (run2,) = client.search_runs([exp.experiment_id])  # active runs: the superseded one is soft-deleted
    assert run2.info.run_id != first and run2.data.tags[RUN_ID_TAG] == run_dir.name
    assert run2.data.tags[PREVIOUS_TAG] == first and client.get_run(first).data.tags[SUPERSEDED_TAG] == run2.info.run_id
    assert client.get_run(first).info.lifecycle_stage == "deleted"
    assert sorted(m.step for m in client.get_metric_history(run2.info.run_id, "time/step")) == list(range(1, k + 2))
    changed = [f.path for f in client.list_artifacts(run2.info.run_id, "resumes")]
    assert changed == [f"resumes/step_{k}.yaml"]
    text = Path(client.download_artifacts(run2.info.run_id, changed[0], str(tmp_path / "dl2"))).read_text()
    assert f"runner.max_steps: {k + 1}" in text
