"""What a user reads about the MLflow store: the end-of-run `view:` hint per kind of tracking uri, MLflow's own
"View run" lines kept out of dagrl's output, and the pre-flight's bounded wait for a tracking server that is
still starting (storage.tracking). Unit tier: local sockets and threads only, no MLflow server."""
from __future__ import annotations

import http.server
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from storage.tracking import PROBE_TIMEOUT_S, SERVER_COMMAND, check_tracking_uri, view_hint


def test_view_hint_opens_a_servers_ui_and_serves_a_store_with_mlflow_ui():
    # a server: its own UI at the run's page (MLflow's link layout: <host>/#/experiments/<exp>/runs/<run>); `mlflow
    # ui --backend-store-uri http://...` is what crashed (UnsupportedModelRegistryStoreURIException)
    assert view_hint("http://127.0.0.1:5058", "3", "abc") == "open http://127.0.0.1:5058/#/experiments/3/runs/abc"
    assert view_hint("https://mlflow.lab/", "3", None) == "open https://mlflow.lab/#/experiments/3"
    assert view_hint("http://h:5000?x=1") == "open http://h:5000"
    for uri in ("sqlite:////tmp/runs/mlflow.db", "file:///tmp/mlruns", "/tmp/mlruns",
                "postgresql://u:p@db:5432/mlflow"):
        assert view_hint(uri, "3", "abc") == f"mlflow ui --backend-store-uri {uri}"
    assert "mlflow ui" not in view_hint("databricks", "3", "abc")


def test_mlflows_view_run_lines_are_silenced_where_dagrl_ends_a_run(capsys, monkeypatch):
    """MLflow's client prints "🏃 View run ..." when a run on a server is set terminated (TrackingServiceClient
    ._log_url); storage.tracking's `_no_run_url_lines` (around every set_terminated of Tracker) turns it off through
    the variable MLflow reads, and leaves a value the user set as it is."""
    from mlflow.store.tracking.rest_store import RestStore
    from mlflow.tracking._tracking_service.client import TrackingServiceClient
    from mlflow.utils.rest_utils import MlflowHostCreds

    from storage.tracking import _URL_LINES_OFF, _no_run_url_lines
    monkeypatch.delenv(_URL_LINES_OFF, raising=False)
    store = RestStore(lambda: MlflowHostCreds("http://127.0.0.1:5058"))
    run = SimpleNamespace(info=SimpleNamespace(experiment_id="3", run_name="r"), data=SimpleNamespace(tags={}))
    monkeypatch.setattr(store, "get_run", lambda run_id: run)
    client = TrackingServiceClient("http://127.0.0.1:5058")
    monkeypatch.setattr(TrackingServiceClient, "store", property(lambda self: store))
    capsys.readouterr()
    client._log_url("abc")
    assert "View run r at: http://127.0.0.1:5058/#/experiments/3/runs/abc" in capsys.readouterr().out  # MLflow's
    with _no_run_url_lines():
        client._log_url("abc")
    assert capsys.readouterr().out == ""
    assert _URL_LINES_OFF not in os.environ  # put back as it was
    monkeypatch.setenv(_URL_LINES_OFF, "false")  # the user's own choice stands
    with _no_run_url_lines():
        assert os.environ[_URL_LINES_OFF] == "false"


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # MLflow's /health answers 200 "OK"
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_preflight_waits_for_a_server_that_starts_late_within_the_bound():
    port = _free_port()
    servers = []

    def start_later():  # the server binds its port only after a delay, as a loaded `mlflow server` does
        time.sleep(1.5)
        srv = http.server.HTTPServer(("127.0.0.1", port), _Health)
        servers.append(srv)
        srv.serve_forever()

    threading.Thread(target=start_later, daemon=True).start()
    said = []
    t0 = time.monotonic()
    try:
        check_tracking_uri(f"http://127.0.0.1:{port}", wait_s=30, on_wait=said.append)
    finally:
        while not servers and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        for srv in servers:
            srv.shutdown()
    assert 1.5 <= time.monotonic() - t0 < 30
    assert said == [f"waiting for the MLflow server at http://127.0.0.1:{port}/health (up to 30 s: tracking.wait_s)"]


def test_preflight_gives_up_at_its_bound_and_names_it_and_the_fix():
    port = _free_port()  # nothing listens
    said = []
    t0 = time.monotonic()
    with pytest.raises(ValueError) as err:
        check_tracking_uri(f"http://127.0.0.1:{port}", wait_s=1.0, on_wait=said.append)
    waited = time.monotonic() - t0
    assert 1.0 <= waited < 1.0 + PROBE_TIMEOUT_S + 2  # the bound, plus at most one request's own timeout
    msg = str(err.value)
    assert f"no MLflow server answered http://127.0.0.1:{port}/health within 1 s (tracking.wait_s" in msg
    assert "raise tracking.wait_s" in msg and SERVER_COMMAND in msg and len(said) == 1
    # wait_s=0 (pipelines.compare reading a store): one try, no wait, no key it does not have in the message
    with pytest.raises(ValueError, match=r"waited up to 3 s\); start the server") as err:
        check_tracking_uri(f"http://127.0.0.1:{port}")
    assert "tracking.wait_s" not in str(err.value)


def test_the_documented_server_command_runs_no_job_runner():
    """The fix's command is the compose file's server: MLflow's job runner off (docker-compose.yml sets
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false for its `mlflow` service)."""
    from pathlib import Path
    compose = (Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text()
    assert 'MLFLOW_SERVER_ENABLE_JOB_EXECUTION: "false"' in compose
    assert SERVER_COMMAND.startswith("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server ")
    from mlflow.environment_variables import MLFLOW_SERVER_ENABLE_JOB_EXECUTION  # the variable MLflow reads
    assert MLFLOW_SERVER_ENABLE_JOB_EXECUTION.name == "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"
