"""Broken workers mid-run, at deterministic points (`pipelines.faults.FaultAt`: the fault happens when a given task
starts on a given worker, once), so these run in the default suite and cannot flake on where a kill lands.

- a killed env worker: its shard is re-created from the step's seed cursor and the step retried;
- a killed actor worker: the actor is restored from the last checkpoint (the run rolls back to that step and redoes
  the steps after it);
- a paused env worker (memory): detected within `runner.pause_timeout_s`, one line naming it, its memory and the
  key to change; the step is retried on the healthy workers;
- giving up (`pipelines.run.main`, as a user runs it): retries exhausted (`runner.max_retries=0`, a killed env
  worker) and no healthy placement left (`runner.max_retries=1`, every env worker paused) both end with ONE line
  `error: training step N: <what failed>; <what was saved>; <what to change>`, exit 1, and a checkpoint of the last
  finished step that loads;
- the siblings no cluster is needed for (a fake runner): the cluster gone during a wait, the checkpoint graph
  itself failing, the actor lost with the retries exhausted, an evaluation's retries exhausted;
- the issue's input, `DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE=0.01 python -m pipelines.run conf=smoke`: every worker
  is paused from the start; exit 1 with one line instead of a hang.

Cost: one embedded cluster for every in-process test (module fixture; each test restores the workers it broke:
restarted by their Nannies, or un-paused) plus the subprocess of the issue's input; tiny rollouts (4 chunk steps,
two env nodes per shard and step).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelines.clusters import start_cluster
from pipelines.config import load_config
from pipelines.faults import FaultAt, restore_pause
from pipelines.runner import Runner
from pipelines.runner.recovery import Recovery, RunStalled
from pipelines.runner.scheduler import Lost, Scheduler
from pipelines.runner.watcher import Watcher
from storage.checkpoints import checkpoint_step, latest_checkpoint, load_checkpoint, save_checkpoint
from storage.trajectories import TrajectoryStore

pytestmark = pytest.mark.timeout(600)  # a hang fails the test instead of the suite (a cluster test takes 3-5 min at load 20)

# two env nodes per shard and step: a worker paused as a step's first node starts holds up its second one (with one,
# the rest of the step needs nothing more from it and the pause would be seen only in a later graph)
TINY = ["rollout.chunk_steps=4", "rollout.chunk_steps_per_node=2", "env.max_episode_steps=6",
        "policy.hidden_sizes=[32,32]"]
BASE = ["conf=smoke", "runner.pause_timeout_s=3", *TINY]
RESUME = "then resume with `python -m pipelines.run conf=<this config> runner.resume={rid}`"


def _env_steps(cfg, steps: int) -> int:
    return steps * cfg.env.num_envs * cfg.rollout.chunk_steps * cfg.policy.num_action_chunks


def _newest(history) -> dict:
    """step -> the newest value logged at that step (a rolled-back step may be logged again)."""
    return dict(history)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One embedded cluster (conf=smoke: 2 env workers, 1 GPU worker) for the module's in-process tests."""
    cfg, _ = load_config([*BASE, f"run_root={tmp_path_factory.mktemp('cluster')}"])
    handle = start_cluster(cfg)
    yield handle
    handle.close()


class _Faults:
    """Install FaultAt plugins; `undo()` removes them and un-pauses the workers they paused (the next test finds
    the cluster whole: killed workers are back through their Nannies)."""

    def __init__(self, client):
        self.client, self.names, self.paused = client, [], []

    def add(self, addr: str, key: str, action: str) -> None:
        name = f"dagrl-test-fault-{len(self.names)}"
        self.client.register_plugin(FaultAt(addr, key, action), name=name)
        self.names.append(name)
        if action == "pause":
            self.paused.append(addr)

    def undo(self, n_workers: int = 3) -> None:
        for name in self.names:
            self.client.unregister_worker_plugin(name)
        live = set(self.client.scheduler_info(n_workers=-1)["workers"])
        if self.paused:
            self.client.run(restore_pause, workers=[a for a in self.paused if a in live], on_error="ignore")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            ws = self.client.scheduler_info(n_workers=-1)["workers"].values()
            if len(ws) == n_workers and all(w.get("status") == "running" for w in ws):
                return
            time.sleep(0.5)
        raise AssertionError(f"the cluster did not come back whole: {list(ws)}")


@pytest.fixture
def faults(cluster):
    f = _Faults(cluster.client)
    yield f
    f.undo()


def _runner(cluster, tmp_path, *overrides):
    cfg, _ = load_config([*BASE, f"run_root={tmp_path}", *overrides])
    said: list[str] = []
    return cfg, Runner(cfg, cluster, echo=said.append), said


def _name(client, addr: str) -> str:
    return client.scheduler_info(n_workers=-1)["workers"][addr]["name"]


# victim, runner overrides, the task at which the victim dies ({rid}: run id), newest train/retries per step
KILLS = [
    # shard 1's worker dies as step 2's first env node starts: the shard is re-created from the step's cursor
    ("env", ["runner.max_steps=2", "runner.save_interval=2", "runner.val_check_interval=2"],
     "env_step_s1-{rid}-1-0", {1: 0.0, 2: 1.0}),
    # the actor's worker dies as step 3's update starts: rolled back to the step-2 checkpoint, step 3 redone
    ("actor", ["runner.max_steps=3", "runner.save_interval=2", "runner.val_check_interval=3"],
     "actor_update-{rid}-2", {1: 0.0, 2: 0.0, 3: 1.0}),
]


@pytest.mark.parametrize("victim,overrides,key,retries", KILLS, ids=[k[0] for k in KILLS])
def test_killed_worker_is_recovered(cluster, faults, tmp_path, victim, overrides, key, retries):
    cfg, runner, said = _runner(cluster, tmp_path, *overrides)
    rid = runner.state.run_id
    addr = runner.placement.shard_workers[1] if victim == "env" else runner.placement.actor_worker
    faults.add(addr, key.format(rid=rid), "kill")
    res = runner.run()
    n = cfg.runner.max_steps
    assert res.steps == n and res.env_steps == _env_steps(cfg, n)
    lost = [m for m in said if "lost during step" in m]
    assert len(lost) == 1 and addr in lost[0], said
    if victim == "env":
        assert "lost during step 2; retrying" in lost[0]  # step 2 was in flight
        assert addr not in runner.placement.shard_workers  # the restarted worker has a new address
    else:
        assert "lost during step 3; restoring the actor from the last checkpoint" in lost[0]
        assert runner.placement.actor_worker != addr
    assert _newest(runner.tracker.get_metric_history("train/retries")) == retries
    versions = _newest(runner.tracker.get_metric_history("train/weight_version"))
    assert versions == {s: float(s) for s in range(1, n + 1)}
    assert TrajectoryStore.open(res.store_path).complete_steps().tolist() == list(range(n))
    assert load_checkpoint(latest_checkpoint(res.run_dir))["run"]["runner"]["step"] == n


def test_paused_env_worker_is_left_out(cluster, faults, tmp_path):
    """Shard 1's worker pauses for memory as step 2's first env node starts: within pause_timeout_s the run names it
    (one line: worker, state, memory, the keys to change) and retries step 2 with both shards on the other worker."""
    cfg, runner, said = _runner(cluster, tmp_path, "runner.max_steps=2", "runner.save_interval=2",
                                "runner.val_check_interval=2")
    rid = runner.state.run_id
    addr, other = runner.placement.shard_workers[1], runner.placement.shard_workers[0]
    assert addr != other
    faults.add(addr, f"env_step_s1-{rid}-1-0", "pause")
    res = runner.run()
    assert res.steps == 2 and res.env_steps == _env_steps(cfg, 2)
    lines = [m for m in said if "paused for memory" in m]
    assert len(lines) == 1, said
    assert f"worker {_name(cluster.client, addr)} ({addr}) paused for memory" in lines[0]
    assert "cluster.memory_limit" in lines[0] and "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE" in lines[0]
    assert "process memory" in lines[0] and "pause fraction 1e-09" in lines[0]
    assert any(f"retrying without ['{addr}']" in m for m in said), said
    assert runner.placement.shard_workers == [other, other]
    assert _newest(runner.tracker.get_metric_history("train/retries")) == {1: 0.0, 2: 1.0}
    assert TrajectoryStore.open(res.store_path).complete_steps().tolist() == [0, 1]


# ----- giving up: one line, exit 1, the checkpoint written -----
def _main_on(cluster, monkeypatch, capsys, args: list[str], inject) -> tuple[int, list[str], str]:
    """`pipelines.run.main(args)` on the module's cluster, `inject(runner)` called once the Runner is built.
    Returns (exit code, stderr's lines, stdout)."""
    import pipelines.clusters
    import pipelines.runner
    from pipelines import run

    h = cluster

    class Shared:  # the module's cluster, not closed by the command
        client, cluster, dashboard_link = h.client, h.cluster, h.dashboard_link

        def close(self):
            pass

    class Injected(Runner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            inject(self)
    monkeypatch.setattr(pipelines.clusters, "start_cluster", lambda cfg: Shared())
    monkeypatch.setattr(pipelines.runner, "Runner", Injected)
    term = signal.getsignal(signal.SIGTERM)
    try:
        code = run.main(args)
    finally:
        signal.signal(signal.SIGTERM, term)
    out = capsys.readouterr()
    return code, out.err.splitlines(), out.out


def _the_error(lines: list[str]) -> str:
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], lines
    assert not any("Traceback" in ln for ln in lines), lines
    return errors[0]


def test_retries_exhausted_end_with_one_line_and_a_checkpoint(cluster, faults, tmp_path, monkeypatch, capsys):
    """runner.max_retries=0, shard 1's worker killed as step 2's env node starts: the retry loop gives up at once;
    the actor is healthy, so the step-1 checkpoint is written (the watch narrowed to the actor: the lost env
    worker does not stop it) and the line names the worker, the checkpoint and the keys to change."""
    seen = {}

    def inject(runner):
        addr = runner.placement.shard_workers[1]
        seen.update(rid=runner.state.run_id, addr=addr, name=_name(runner.client, addr), run_dir=runner.run_dir)
        faults.add(addr, f"env_step_s1-{runner.state.run_id}-1-0", "kill")
    code, err, _ = _main_on(cluster, monkeypatch, capsys, [
        *BASE, f"run_root={tmp_path}", "runner.max_retries=0", "runner.max_steps=3", "runner.save_interval=3",
        "runner.val_check_interval=3"], inject)
    assert code == 1
    line = _the_error(err)
    ckpt = latest_checkpoint(seen["run_dir"])
    assert ckpt is not None and checkpoint_step(ckpt) == 1
    assert line == (f"error: training step 2: worker {seen['name']} ({seen['addr']}) lost (left the cluster or "
                    f"restarted), on each of 1 attempt(s) (runner.max_retries=0); wrote checkpoint {ckpt} (step 1, "
                    f"the last finished step); raise cluster.memory_limit (now 3GiB) if the worker ran out of "
                    f"memory, or raise runner.max_retries (now 0), " + RESUME.format(rid=seen["rid"]))
    meta = load_checkpoint(ckpt)
    assert meta["run"]["runner"]["step"] == 1 and meta["run"]["weight_version"] == 1 and meta["policy"]


def test_no_healthy_placement_ends_with_one_line_and_a_checkpoint(cluster, faults, tmp_path, monkeypatch, capsys):
    """runner.max_retries=1, both env workers pause as step 2's env nodes start: `_recover` finds no placement
    without them; the actor is healthy, so the step-1 checkpoint is written; one line, exit 1."""
    seen = {}

    def inject(runner):
        shards = list(runner.placement.shard_workers)
        seen.update(rid=runner.state.run_id, shards=shards, run_dir=runner.run_dir)
        for s in (0, 1):
            faults.add(shards[s], f"env_step_s{s}-{runner.state.run_id}-1-0", "pause")
    code, err, out = _main_on(cluster, monkeypatch, capsys, [
        *BASE, f"run_root={tmp_path}", "runner.max_retries=1", "runner.max_steps=3", "runner.save_interval=3",
        "runner.val_check_interval=3"], inject)
    assert code == 1
    line = _the_error(err)
    ckpt = latest_checkpoint(seen["run_dir"])
    assert ckpt is not None and checkpoint_step(ckpt) == 1
    pat = (r"error: training step 2: (worker env-\d \(tcp://[\d.:]+\) paused for memory(, )?)+: no healthy "
           r"placement without the paused worker\(s\) \[.*\]; " + re.escape(f"wrote checkpoint {ckpt} (step 1, "
           f"the last finished step); raise cluster.memory_limit (now 3GiB) or the pause fraction "
           f"(DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE), ") + re.escape(RESUME.format(rid=seen["rid"])))
    assert re.fullmatch(pat, line), line
    assert "--resources" not in line, line  # the workers exist: the pause is the cause, not a missing resource
    assert all(a in line for a in seen["shards"]), line
    assert load_checkpoint(ckpt)["run"]["runner"]["step"] == 1
    assert len([ln for ln in out.splitlines() if "paused for memory" in ln]) == 1, out


# ----- giving up, the paths a fake runner reaches (no cluster) -----
class _FakeClient:
    def __init__(self, status="running"):
        self.status = status
        self.scheduler = SimpleNamespace(identity=None)

    def sync(self, fn, *a, **kw):
        if self.status != "running":
            raise OSError("Timed out trying to connect to tcp://127.0.0.1:8786")

    def scheduler_info(self, n_workers=0):
        return {"workers": {}}

    def get(self, graph, keys, sync=False):
        return []


class _Fake:
    """The Scheduler and its Recovery on a fake run: step 2 finished, a checkpoint of step 1 on disk; the recovery's
    `checkpoint` writes a real one (or raises `ckpt_error`); its `recover` only counts."""

    def __init__(self, tmp_path, max_retries: int, ckpt_error: Exception | None = None, status="running"):
        self.cfg, _ = load_config([*BASE, f"run_root={tmp_path}", f"runner.max_retries={max_retries}"])
        client = _FakeClient(status)
        self.state = SimpleNamespace(step=2, run_id="run-x", elapsed_s=0.0)
        placement = SimpleNamespace(actor_workers=["tcp://a:1"], shard_workers=["tcp://e:1", "tcp://e:2"],
                                    rollout_workers=[], actor_worker="tcp://a:1")
        watch = Watcher(self.cfg, client, placement, placed_ids={})
        watch._names.update({"tcp://a:1": "gpu-0", "tcp://e:1": "env-0", "tcp://e:2": "env-1"})
        watch.drop = lambda futs: None
        self.run_dir = tmp_path / "run"
        ctx = SimpleNamespace(run_dir=self.run_dir, store=None)
        self.old = save_checkpoint(self.run_dir, 1, {"run": {"runner": {"step": 1}}})
        self.ckpt_error, self.recovered = ckpt_error, 0
        self.recovery = Recovery(self.cfg, self.state, watch=watch, ctx=ctx, checkpoint=self.checkpoint,
                                 rollback=None)
        self.recovery.recover = self._recover
        self.sched = Scheduler(self.cfg, client, self.state, watch=watch, ctx=ctx, recovery=self.recovery)

    def checkpoint(self, elapsed):
        if self.ckpt_error is not None:
            raise self.ckpt_error
        return save_checkpoint(self.run_dir, self.state.step, {"run": {"runner": {"step": self.state.step}}})

    def _recover(self, lost, step, busy=frozenset(), during=None):
        self.recovered += 1


FAKE_CASES = [
    # (id, max_retries, lost workers, what, checkpoint error, expected line (after "training step "))
    ("env-lost-twice", 1, {"tcp://e:2"}, "training step", None,
     "3: worker env-1 (tcp://e:2) lost (left the cluster or restarted), on each of 2 attempt(s) "
     "(runner.max_retries=1); wrote checkpoint {new} (step 2, the last finished step); raise cluster.memory_limit "
     "(now 3GiB) if the worker ran out of memory, or raise runner.max_retries (now 1), " + RESUME),
    ("actor-lost", 0, {"tcp://a:1"}, "training step", None,
     "3: worker gpu-0 (tcp://a:1) lost (left the cluster or restarted), on each of 1 attempt(s) "
     "(runner.max_retries=0); no checkpoint written (the actor's weights were on the failed worker(s)); the latest "
     "is {old}; raise cluster.memory_limit (now 3GiB) if the worker ran out of memory, or raise runner.max_retries "
     "(now 0), " + RESUME),
    ("eval-checkpoint-fails", 0, {"tcp://e:1"}, "evaluation", OSError(28, "No space left on device"),
     "2: evaluation: worker env-0 (tcp://e:1) lost (left the cluster or restarted), on each of 1 attempt(s) "
     "(runner.max_retries=0); no checkpoint written (writing it failed: [Errno 28] No space left on device); the "
     "latest is {old}; raise cluster.memory_limit (now 3GiB) if the worker ran out of memory, or raise "
     "runner.max_retries (now 0), " + RESUME),
]


@pytest.mark.parametrize("case", FAKE_CASES, ids=[c[0] for c in FAKE_CASES])
def test_retry_exhaustion_line(tmp_path, case):
    _, retries, lost, what, error, expected = case
    fake = _Fake(tmp_path, retries, ckpt_error=error)
    with pytest.raises(RunStalled) as exc:
        fake.sched.retrying(lambda attempt: Lost(set(lost)), what)
    assert fake.recovered == retries
    new = latest_checkpoint(fake.run_dir)
    assert str(exc.value) == "training step " + expected.format(new=new, old=fake.old, rid="run-x")
    assert "\n" not in str(exc.value)
    assert checkpoint_step(new) == (2 if "wrote checkpoint" in expected else 1)
    assert load_checkpoint(new)["run"]["runner"]["step"] == checkpoint_step(new)


def test_cluster_gone_during_a_wait_is_one_line(tmp_path):
    """The scheduler gone: the client cancels every future (a CancelledError, not an Exception) and its status
    leaves "running"; the line says so and names the latest checkpoint (the actor was on the cluster)."""
    from distributed.client import FutureCancelledError
    fake = _Fake(tmp_path, 3, status="closed")

    def once(attempt):
        raise FutureCancelledError("step_metrics-run-x-2", "scheduler-connection-lost")
    with pytest.raises(RunStalled) as exc:
        fake.sched.retrying(once, "training step")
    msg = str(exc.value)
    assert msg.startswith("training step 3: the cluster is gone: the client's connection to the scheduler is "
                          "closed (the wait ended with FutureCancelledError: "), msg
    assert msg.endswith(f"; no checkpoint written (the actor's weights were on the cluster); the latest is "
                        f"{fake.old}; check the scheduler and its workers (cluster.address, or the embedded "
                        f"cluster's log), " + RESUME.format(rid="run-x")), msg
    assert fake.recovered == 0
    # the scheduler still answering: the same error is the run's own, not a lost cluster (no line, re-raised)
    with pytest.raises(FutureCancelledError):
        _Fake(tmp_path / "b", 3).sched.retrying(once, "training step")


def test_checkpoint_graph_failing_is_one_line(tmp_path):
    """A task of the checkpoint graph raises (disk full): no retry, one line naming what failed and the latest
    checkpoint on disk (the new one is what failed)."""
    fake = _Fake(tmp_path, 3)
    fake.sched._await = lambda futs, keep: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    with pytest.raises(RunStalled) as exc:
        fake.sched.compute(lambda attempt: ({}, ["checkpoint-run-x-2"]), "checkpoint")
    assert str(exc.value) == (
        f"training step 2: checkpoint: writing the checkpoint of step 2 under {fake.run_dir} failed (OSError: "
        f"[Errno 28] No space left on device); no checkpoint written (writing it is what failed); the latest is "
        f"{fake.old}; check that run_root ({fake.cfg.run_root}) is writable and has free space, "
        + RESUME.format(rid="run-x"))


@pytest.mark.parametrize("what", ["checkpoint", "evaluation", "validation"])
def test_checkpoint_of_an_actor_gone_from_its_worker_is_not_called_a_disk_problem(tmp_path, what):
    """The checkpoint graph's actor_state, or an eval's eval_weights (algorithm.ema_decay: the average lives in the
    actor), raising tasks.actor.actor.ActorMissing (the actor's worker process was restarted, e.g. killed by a signal
    from outside): one line saying the actor is gone, not 'check that run_root is writable' (what the checkpoint's
    said before) nor a traceback (the eval's)."""
    from tasks.actor.actor import ActorMissing
    fake = _Fake(tmp_path, 3)
    fake.sched._await = lambda futs, keep: (_ for _ in ()).throw(ActorMissing("no resident actor for run run-x on this "
                                                                        "worker"))
    with pytest.raises(RunStalled) as exc:
        fake.sched.compute(lambda attempt: ({}, [f"{what}-run-x-2"]), what)
    msg = str(exc.value)
    assert msg.startswith(f"training step 2: {what}: the actor of step 2 is gone from its worker (the worker "
                          "process was restarted: no resident actor for run run-x on this worker); no checkpoint "
                          f"written (the actor's state was lost); the latest is {fake.old}; resume from the last "
                          "checkpoint"), msg
    assert "writable" not in msg and "\n" not in msg


def test_memory_paused_cluster_exits_with_one_line(tmp_path):
    """The issue's input: every worker pauses at start-up (pause fraction 0.01 of 3 GiB, 31 MiB, is below a bare
    worker's ~64 MiB; 0.05 = 154 MiB is crossed only once tasks import torch, so the pause lands in the init graph
    or in step 1 by timing); the init graph's wait reports it and the run exits 1 with one `error:` line, no hang."""
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE": "0.01"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pipelines.run", "conf=smoke", f"run_root={tmp_path}",
                           "runner.pause_timeout_s=3"], env=env, capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = _the_error([ln for ln in proc.stderr.splitlines() if ln.strip()])
    assert re.fullmatch(r"error: training step 1: the init graph: (worker \S+ \(tcp://[\d.:]+\) paused for memory"
                        r"(, )?)+; no checkpoint written \(the actor is not initialised\); no checkpoint of this "
                        r"run exists yet; raise cluster.memory_limit \(now 3GiB\) or the pause fraction "
                        r"\(DASK_DISTRIBUTED__WORKER__MEMORY__PAUSE\), then start it again \(no checkpoint to "
                        r"resume from\)", line), line
    paused = [ln for ln in proc.stdout.splitlines() if "paused for memory" in ln]
    assert len(paused) == 1 and "pause fraction 0.01" in paused[0] and "cluster.memory_limit" in paused[0]
    assert time.monotonic() - t0 < 200


def test_placed_worker_ids_are_not_taken_from_a_starved_answer(monkeypatch):
    """The ids the watch compares with are recorded from an answer that lists every placed worker: one
    scheduler_info() reply that lists none (a starved machine) is looked past; recorded, it made every placed
    worker look restarted at the next check (a spurious loss of all workers and a rollback)."""
    from pipelines.runner import watcher as recovery

    full = {"tcp://a": {"id": "A", "name": "env-0"}, "tcp://b": {"id": "B", "name": "env-1"},
            "tcp://g": {"id": "G", "name": "gpu-0"}}
    answers = [{}, {"tcp://g": full["tcp://g"]}, full]

    class Client:
        def scheduler_info(self, n_workers=-1):
            return {"workers": answers.pop(0) if answers else full}

    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    placement = SimpleNamespace(shard_workers=["tcp://a", "tcp://b"], actor_workers=["tcp://g"], rollout_workers=[])
    watcher = recovery.Watcher(None, Client(), placement)
    assert watcher._placed_ids == {"tcp://a": "A", "tcp://b": "B", "tcp://g": "G"}
    assert watcher._lost_workers() == set()  # nothing lost against the recorded ids


def test_a_lost_rollout_worker_counts_as_lost(monkeypatch):
    """Disaggregated inference on its own GPU worker (`placement.rollout_workers`, not the actor's): the
    `policy_infer` nodes are pinned to it, so its loss must end the wait like an env or actor worker's (before,
    only env and actor workers were compared with the recorded ids: the step waited on a dead worker for ever)."""
    from pipelines.runner import watcher as recovery

    full = {"tcp://a": {"id": "A", "name": "env-0"}, "tcp://g": {"id": "G", "name": "gpu-0"},
            "tcp://r": {"id": "R", "name": "gpu-1"}}
    now = dict(full)

    class Client:
        def scheduler_info(self, n_workers=-1):
            return {"workers": dict(now)}

    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    placement = SimpleNamespace(shard_workers=["tcp://a"], actor_workers=["tcp://g"], rollout_workers=["tcp://r"])
    watcher = recovery.Watcher(None, Client(), placement)
    assert watcher._lost_workers() == set()
    del now["tcp://r"]
    assert watcher._lost_workers() == {"tcp://r"}
    now["tcp://r"] = {"id": "R2", "name": "gpu-1"}  # restarted by its Nanny: a new id, its replica gone
    assert watcher._lost_workers() == {"tcp://r"}


@pytest.mark.cluster
def test_the_watch_waits_through_its_own_client_when_another_is_the_default():
    """`distributed.wait` goes through the process's default client, the newest one: a run's watch must wait
    through its own (before: an eval on a cluster started earlier, beside a newer client, failed with 'bound to a
    different event loop')."""
    from distributed import Client, LocalCluster, wait
    from distributed.client import default_client

    from tasks.config import Config

    def slow_sum(xs):
        time.sleep(1.5)
        return sum(xs)
    placement = SimpleNamespace(shard_workers=[], actor_workers=[], rollout_workers=[])
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as c1, Client(c1) as ours, \
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as c2, Client(c2) as newer:
        assert default_client() is newer and ours.loop is not newer.loop
        f = ours.submit(slow_sum, [1, 2, 3])
        with ours.as_current(), pytest.raises(TimeoutError):  # a first wait on our loop (the future's event is
            wait([f], timeout=0.1)  # now bound to it), as a step's wait is before a retry
        watch = Watcher(Config(), ours, placement, echo=lambda *a: None)
        assert watch.results([f], "the test") == [6]
