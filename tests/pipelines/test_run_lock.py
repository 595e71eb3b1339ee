"""One live driver per run directory, through the commands: `pipelines.run runner.resume=<id>` or
`runner.resume=latest` on a run another driver (a real process) holds is refused before any cluster starts, one line
naming the holder, exit 2, nothing in the run dir changed; once that driver is SIGKILLed the same command takes the
run over with a note and holds it while it trains, released at its end; `pipelines.record` into a store another
recording writes and `pipelines.perf --write` on a live run are refused the same way. The slow test does it with a
real training run A and a real second command B."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines import run
from storage.rundir import LOCK_FILE, write_resolved_config
from tests.storage.test_locks import _holder, _listing, _stop  # a real process holding a lock
ROOT = Path(__file__).resolve().parents[2]


def _a_run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "smoke" / "20260101-000000-beef"
    d.mkdir(parents=True)
    (d / ".started").write_text("1")
    return d


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if anything starts a cluster."""
    import pipelines.clusters

    def refuse(cfg):
        raise AssertionError("a cluster was started")
    monkeypatch.setattr(pipelines.clusters, "start_cluster", refuse)


def _err(capsys, main, argv) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(argv)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _checkpointed(tmp_path: Path) -> Path:
    """A run dir `smoke/<id>` with a resolved config and a complete checkpoint at step 2 (no MLflow run)."""
    from dataclasses import asdict

    from pipelines.runner.setup import RunState
    from storage.checkpoints import save_checkpoint
    run_dir = _a_run_dir(tmp_path)
    state = RunState(run_id=run_dir.name, step=2, cursors=[None] * 2)
    save_checkpoint(run_dir, 2, {"run": {"runner": asdict(state), "experiment": "smoke"}})
    write_resolved_config(run_dir, "experiment: smoke\n")
    return run_dir


@pytest.mark.parametrize("which", ["id", "latest"])
def test_resume_of_a_live_run_is_refused_naming_its_driver(tmp_path, capsys, no_cluster, which):
    run_dir = _checkpointed(tmp_path)
    a = _holder("run", run_dir)
    try:
        before = _listing(run_dir)
        resume = run_dir.name if which == "id" else "latest"
        rc, err = _err(capsys, run.main, ["conf=smoke", f"run_root={tmp_path}", f"runner.resume={resume}"])
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: runner.resume='{resume}': ")
        assert f"pid {a.pid} on host " in err[0] and " since " in err[0] and "python -c" in err[0], err
        assert _listing(run_dir) == before and a.poll() is None
    finally:
        _stop(a)


def test_after_its_driver_is_sigkilled_the_resume_takes_the_run_over(tmp_path, capsys, monkeypatch):
    run_dir = _checkpointed(tmp_path)
    a = _holder("run", run_dir)
    _stop(a, signal.SIGKILL)
    seen = {}

    def train(cfg, handle, run_lock=None):  # what pipelines.run hands the Runner: the lock, taken over
        seen["lock"] = run_lock
        seen["holders"] = [json.loads(line)["pid"] for line in (run_dir / LOCK_FILE).read_text().splitlines()]
        return 0
    monkeypatch.setattr(run, "_train", train)
    monkeypatch.setattr(run, "with_cluster", lambda cfg, body: body(None))
    rc, err = _err(capsys, run.main, ["conf=smoke", f"run_root={tmp_path}", f"runner.resume={run_dir.name}"])
    assert rc == 0, err
    assert seen["holders"] == [os.getpid()]  # held by this command while it trains
    assert f"pid {a.pid}" in seen["lock"].note and "no longer running" in seen["lock"].note
    assert not (run_dir / LOCK_FILE).exists()  # released when the command ended


def test_a_second_recording_to_the_same_store_is_refused_before_any_cluster(tmp_path, capsys, no_cluster):
    from pipelines import record
    out = tmp_path / "demos" / "x.zarr"
    a = _holder("write", out)
    try:
        rc, err = _err(capsys, record.main, ["conf=pushcube_record", f"run_root={tmp_path}", f"record.out={out}",
                                             "record.teacher=scripted:libero"])
        assert rc == 2 and len(err) == 1 and err[0].startswith("error: record.out=") and f"pid {a.pid}" in err[0], err
        assert not Path(str(out) + ".partial").exists()
    finally:
        _stop(a)


def test_perf_write_on_a_live_run_is_refused(tmp_path, capsys):
    from pipelines import perf
    run_dir = _a_run_dir(tmp_path)
    (run_dir / "perf").mkdir()
    (run_dir / "perf" / "events.jsonl").write_text(json.dumps({"kind": "session", "t": 0.0, "event": "start"}) + "\n")
    a = _holder("run", run_dir)
    try:
        rc, err = _err(capsys, perf.main, [str(run_dir), "--write"])
        assert rc == 2 and len(err) == 1 and f"pid {a.pid}" in err[0], err
        assert not (run_dir / "perf_summary.json").exists()
    finally:
        _stop(a)


@pytest.mark.slow
def test_two_real_drivers_on_one_run(tmp_path):
    """A real `conf=smoke` run A (enough steps to be training still); `runner.resume=<A's id>` while it trains: B is
    refused in one line naming A's pid, and A ends normally (rc 0) with the lock released."""
    args = [sys.executable, "-m", "pipelines.run", "conf=smoke", "runner.max_steps=60", "runner.save_interval=1",
            f"run_root={tmp_path}"]
    a = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = None
        deadline = time.time() + 300
        while time.time() < deadline and a.poll() is None:
            dirs = list(tmp_path.glob("smoke/*/checkpoints/global_step_1"))
            if dirs:
                run_dir = dirs[0].parent.parent
                break
            time.sleep(1)
        assert run_dir is not None, a.communicate()
        b = subprocess.run([*args[:-1], f"run_root={tmp_path}", f"runner.resume={run_dir.name}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        lines = [line for line in b.stderr.splitlines() if line.strip()]
        assert b.returncode == 2 and len(lines) == 1, (b.returncode, b.stdout, b.stderr)
        assert re.search(rf"pid {a.pid} on host .* since .*python -m pipelines.run conf=smoke", lines[0]), lines
        out, err = a.communicate(timeout=600)
        assert a.returncode == 0, err
        assert "done: step 60 | this session: steps 1-60 (60)" in out
        assert not (run_dir / LOCK_FILE).exists()
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
