"""The command-line entry points as a new user meets them: `--help` with examples, one line and
exit 2 on bad words, `validate --connect` listing the workers, `pipelines.replay --episodes` and its default
pick, and Ctrl-C: one line, also while the cluster starts or closes (in-process with real signals sent to this
process at fixed points, and once through a real `pipelines.run` whose process group gets SIGINT)."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pipelines import cli, compare, perf, record, replay, run, validate
from pipelines import eval as eval_cli
from storage.tracking import check_tracking_uri, default_tracking_uri

REPO = Path(__file__).resolve().parents[2]
MAINS = {"run": run.main, "validate": validate.main, "record": record.main, "replay": replay.main,
         "compare": compare.main, "perf": perf.main, "eval": eval_cli.main}


def _call(capsys, main, *argv) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


def _example_lines(text: str, name: str) -> list[list[str]]:
    """The words of each example command line of `python -m pipelines.NAME` in a help text (comments dropped,
    backslash continuations joined)."""
    text = text.replace("\\\n", " ")
    lines = [ln.split("  #", 1)[0].strip() for ln in text.splitlines()]
    return [shlex.split(ln)[3:] for ln in lines if ln.startswith(f"python -m pipelines.{name} ")]


# ----- --help -----

@pytest.mark.parametrize("name", list(MAINS))
def test_help_shows_examples_that_the_command_accepts(name, capsys):
    """`--help` exits 0 and shows at least two example command lines of that very command; the flags the examples
    use are the command's own (its parser, or its known flags) - a renamed flag cannot leave a stale example."""
    rc, out, err = _call(capsys, MAINS[name], "--help")
    assert rc == 0 and err == []
    assert "xamples:" in out
    examples = _example_lines(out, name)
    assert len(examples) >= 2, out
    for words in examples:
        words = [w.replace("RUN", "20261201-151530-98db") for w in words]
        if name == "replay":  # the words as the command parses them (run_root=DIR: pipelines.cli.as_flags)
            replay._parser().parse_args(cli.as_flags(words, ("run_root",)))
        elif name == "compare":
            compare.parse_args(words)
        elif name == "perf":
            perf.parser().parse_args(cli.as_flags(words, ("run_root",)))
        elif name == "eval":
            eval_cli.parse_args(words)
        else:
            flags, overrides = cli.split_flags(words, {"--show": "", "--connect": ""} if name == "validate"
                                               else {"--show": "", "-m": "", "--multirun": ""} if name == "run" else {}, name)
            assert all("=" in o for o in overrides)


# ----- bad words: one line, exit 2 -----

BAD_WORDS = [
    ("run", ["--bogus"], "unknown flag '--bogus'"),
    ("run", ["conf=smoke", "max_steps"], "'max_steps' is not key=value"),
    ("validate", ["--sho"], "(did you mean '--show'?)"),
    ("record", ["--show"], "takes key=value overrides only"),
    ("record", ["conf=libero_record", "record.teacher=scripted:nope"], "no scripted expert 'nope'"),
    ("record", ["conf=pushcube_record", "record.teacher=scripted:libero"], "drives env.simulator=libero"),
    ("replay", ["RUN", "--bogus"], "unrecognized arguments: --bogus"),
    ("replay", ["RUN", "--episodes", "1,x"], "'x' in '1,x' is not an id"),
    ("replay", ["RUN", "--episodes", "5-2"], "A <= B"),
    ("replay", ["RUN", "--num-episodes", "0"], ">= 1"),
    ("replay", [], "required: RUN_OR_STORE"),
    ("compare", ["RUN", "--bogus"], "unrecognized arguments: --bogus"),
    ("compare", ["RUN", "--metric"], "expected one argument"),
    ("perf", [], "required: RUN"),
    ("perf", ["RUN", "--bogus"], "unrecognized arguments: --bogus"),
    ("eval", [], "required: source"),
    ("eval", ["RUN", "--bogus"], "unrecognized arguments: --bogus"),
    ("eval", ["RUN", "max_steps"], "'max_steps' is not key=value"),
]


@pytest.mark.parametrize("name, argv, words", BAD_WORDS, ids=[f"{n}-{' '.join(a)}" for n, a, _ in BAD_WORDS])
def test_bad_words_exit_2_with_one_line(name, argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written
    rc, out, err = _call(capsys, MAINS[name], *argv)
    assert rc == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith("error: ") and words in err[0] and "Traceback" not in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_split_flags_keeps_hydra_words_and_names_the_known_flags():
    flags, overrides = cli.split_flags(["--show", "conf=smoke", "+a.b=1", "~c"], {"--show": "print"}, "p")
    assert flags == {"--show"} and overrides == ["conf=smoke", "+a.b=1", "~c"]
    with pytest.raises(cli.UsageError, match=r"unknown flag '--connect'; p takes --show \(print\) and key=value"):
        cli.split_flags(["--connect"], {"--show": "print"}, "p")


# ----- validate --connect -----

@pytest.fixture(scope="module")
def external_cluster():
    """A scheduler with two env workers (CPU=1, 2 GiB) and one GPU worker (GPU=1, no memory limit), in-process."""
    from distributed import Scheduler, SpecCluster, Worker
    spec = {name: {"cls": Worker, "options": {"name": name, "resources": res, "nthreads": 1, "memory_limit": mem}}
            for name, res, mem in [("env-0", {"CPU": 1}, "2GiB"), ("env-1", {"CPU": 1}, "2GiB"),
                                   ("gpu-0", {"GPU": 1}, 0)]}
    with SpecCluster(workers=spec, scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1",
                                                                           "dashboard_address": ":0"}}) as c:
        yield c


def test_validate_connect_lists_the_workers_and_what_goes_where(external_cluster, capsys):
    from distributed import Client

    from pipelines.clusters import plan_placement
    from pipelines.config import load_config
    addr = external_cluster.scheduler_address
    with Client(addr) as client:
        info = client.scheduler_info(n_workers=-1)
    by_name = {w["name"]: a for a, w in info["workers"].items()}
    overrides = ["conf=smoke", "cluster=address", f"cluster.address={addr}"]  # (notes: smoke's local-cluster keys)
    rc, out, err = _call(capsys, validate.main, *overrides, "--connect")
    assert rc == 0 and all(ln.startswith("note: ") for ln in err), err
    lines = out.splitlines()
    start = lines.index(f"  workers: 3 at {addr}")
    rows = {ln.split()[0]: ln for ln in lines[start + 1:start + 4]}
    assert set(rows) == {"env-0", "env-1", "gpu-0"}
    cfg, _ = load_config(overrides, components=False)
    placement = plan_placement(cfg, info)  # what the run would do on these workers
    for name, res, mem in [("env-0", "CPU=1", "2.00 GiB"), ("env-1", "CPU=1", "2.00 GiB"),
                           ("gpu-0", "GPU=1", "no limit")]:
        row = rows[name]
        assert by_name[name] in row and f"resources {res}" in row and mem in row and "running" in row, row
        shards = [s for s, w in enumerate(placement.shard_workers) if w == by_name[name]]
        assert all(f"env shard {s}" in row for s in shards) and ("actor" in row) == (
            by_name[name] == placement.actor_worker), row
    # the embedded cluster (no cluster.kind=address) has nothing to connect to: one line, exit 2
    rc, out, err = _call(capsys, validate.main, "conf=smoke", "--connect")
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: cluster.address=None: --connect"), err


# ----- pipelines.replay: --episodes and the default pick -----

def test_parse_episodes_reads_ids_and_inclusive_ranges_in_order():
    assert replay.parse_episodes("0,3,10-12") == [0, 3, 10, 11, 12]
    assert replay.parse_episodes("7") == [7] and replay.parse_episodes("4-4") == [4]
    assert replay.parse_episodes(" 2 , 0-1") == [2, 0, 1]
    args = replay._parser().parse_args(["RUN", "--episode", "2", "--episodes", "5-6", "--episode", "1"])
    assert [i for spec in args.episodes for i in spec] == [2, 5, 6, 1]  # the old flag: the same option


def test_worth_watching_orders_best_success_worst_failure_then_extremes():
    from storage.episodes import WATCH_ORDER, worth_watching
    outcomes = {0: (1.0, True), 1: (0.2, False), 2: (3.0, True), 3: (0.1, False), 4: (2.0, False), 5: (0.5, True)}
    got = worth_watching(outcomes)
    assert [e for e, _ in got][:2] == [2, 3]  # the highest-return success, the lowest-return failure
    assert [why for _, why in got][:2] == list(WATCH_ORDER[:2])
    rest = sorted(set(outcomes) - {2, 3}, key=lambda e: -outcomes[e][0])  # 4, 0, 5, 1 by return
    assert [e for e, _ in got][2:] == [rest[0], rest[-1], rest[1], rest[-2]]
    assert sorted(e for e, _ in got) == sorted(outcomes)  # each once
    # no failure: the best success, then the extremes of the rest; ties go to the lower id
    assert [e for e, _ in worth_watching({0: (1.0, True), 1: (1.0, True), 2: (0.0, True)})] == [0, 1, 2]
    assert [e for e, _ in worth_watching({3: (0.0, False), 1: (0.0, False)})] == [1, 3]
    assert worth_watching({}) == []


def test_stored_outcomes_sum_executed_rewards_and_any_success():
    """2 complete steps of T=2, 2 envs, C=2: episode 0 (env 0) spans both steps, its 2nd action of the last chunk
    step not executed; episode 1 (env 1) only the first step, successful at its second chunk step."""
    from storage.episodes import Episode, StoreIndex, stored_outcomes
    S, T, B, C = 2, 2, 2, 2
    rewards = np.arange(S * T * B * C, dtype=np.float32).reshape(S, T, B, C)
    mask = np.ones((S * T, B, C), bool)
    mask[3, 0, 1] = False
    success = np.zeros((S * T, B), bool)
    success[1, 1] = True
    zeros = np.zeros((S * T, B), np.int64)
    idx = StoreIndex(steps=np.array([0, 1]), T=T, num_envs=B, episode_id=zeros, episode_seed=zeros, step_mask=mask,
                     terminated=zeros.astype(bool), truncated=zeros.astype(bool), success=success,
                     contiguous=np.ones(S * T, bool))

    class Store:
        def read(self, name, steps):
            assert name == "rewards" and list(steps) == [0, 1]
            return rewards
    eps = {0: Episode(0, 0, 0, [0, 1, 2, 3], True, True), 1: Episode(1, 1, 1, [0, 1], True, True)}
    flat = rewards.reshape(S * T, B, C)
    want0 = sum(flat[p, 0, c] for p in range(4) for c in range(C) if not (p == 3 and c == 1))
    want1 = sum(flat[p, 1, c] for p in range(2) for c in range(C))
    assert stored_outcomes(Store(), idx, eps) == {0: (pytest.approx(want0), False), 1: (pytest.approx(want1), True)}


# ----- Ctrl-C: one line -----

class _Handle:
    """A stand-in cluster handle whose close() can be interrupted by a real signal to this process."""

    def __init__(self, signal_in_close=False):
        self.signal_in_close, self.closed = signal_in_close, False
        self.dashboard_link = ""

    def close(self):
        if self.signal_in_close:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs between bytecodes: here, inside close
        self.closed = True


@pytest.mark.parametrize("when", ["start", "body", "close", "close_after_interrupt", "sigterm_in_body"])
def test_an_interrupt_anywhere_in_with_cluster_is_one_line(when, monkeypatch, capsys):
    import pipelines.clusters
    handle = _Handle(signal_in_close=when.startswith("close"))

    def start(cfg):
        if when == "start":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        return handle

    def body(h):
        if when in ("body", "close_after_interrupt"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        if when == "sigterm_in_body":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
        return 0
    monkeypatch.setattr(pipelines.clusters, "start_cluster", start)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    capsys.readouterr()
    rc = cli.with_cluster(None, body)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 130 and len(err) == 1, err
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    if when == "start":
        assert err[0].startswith("interrupted while the cluster was starting") and not handle.closed
    elif when == "close":
        assert err[0].startswith("interrupted (SIGINT) while the cluster was closing (the run had ended with exit "
                                 "code 0)") and handle.closed
    else:  # interrupted in the body: the close still ran to its end, a second interrupt there adds nothing
        assert err[0] == "interrupted" and handle.closed


def test_embedded_workers_ignore_sigint():
    """The preload every embedded worker gets makes its process ignore SIGINT (here: this main thread)."""
    from pipelines import worker_preload
    old = signal.getsignal(signal.SIGINT)
    try:
        worker_preload.dask_setup(None)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_workers_error_about_a_lost_peer_is_dropped_others_show():
    """A surviving worker logged Dask's "failed during get data" error with a ~20-line ConnectionResetError
    traceback when the worker it served was lost (the driver reports the loss itself, one line); other errors of
    the worker logger still show."""
    import logging

    from pipelines import worker_preload
    log = logging.getLogger("distributed.worker")
    before = list(log.filters)
    old = signal.getsignal(signal.SIGINT)
    try:
        worker_preload.dask_setup(None)
        worker_preload.dask_setup(None)  # a restart in the same process adds no second filter
        mine = [f for f in log.filters if isinstance(f, worker_preload.PeerGoneFilter)]
        assert len(mine) == 1

        def record(msg, exc):
            return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, msg, ("a", "b"),
                                     (type(exc), exc, None) if exc is not None else None)
        assert not log.filter(record("failed during get data with %s -> %s", ConnectionResetError(104, "reset")))
        assert log.filter(record("failed during get data with %s -> %s", ValueError("a bug")))
        assert log.filter(record("Compute Failed %s %s", OSError("disk")))
        assert log.filter(record("failed during get data with %s -> %s", None))
    finally:
        signal.signal(signal.SIGINT, old)
        log.filters[:] = before


@pytest.mark.timeout(400)
def test_ctrl_c_on_a_real_run_prints_one_line(tmp_path):
    """`python -m pipelines.run conf=smoke` in its own process group, SIGINT to the whole group (what a terminal's
    Ctrl-C does) as soon as the cluster is up (the `dagrl: experiment` line): exit 130, one line on stderr, no
    worker traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.run", "conf=smoke", f"run_root={tmp_path}",
                             "runner.progress=false"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        for line in proc.stdout:
            if line.startswith("dagrl: experiment"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    err = [ln for ln in err if ln.strip() and " INFO mlflow" not in ln]  # a new store's migrations log lines
    # "interrupted", or "interrupted (X after the Ctrl-C)" when a library turned the KeyboardInterrupt into X
    assert rc == 130 and len(err) == 1 and err[0].startswith("interrupted"), err
    check_tracking_uri(default_tracking_uri(tmp_path))  # the store the run began is not left half-made


@pytest.mark.timeout(400)
def test_sigterm_to_the_whole_process_group_checkpoints_the_finished_steps(tmp_path):
    """`python -m pipelines.run conf=smoke` in its own process group, SIGTERM to the whole group (GNU timeout,
    Slurm's scancel, systemd) once a training step is done: the workers, in their own session
    (`pipelines.worker_preload`), live on; the driver finishes its step and checkpoints it (exit 130). Before, the
    signal killed every worker too: the driver reported them lost, rolled back to a fresh actor and checkpointed
    step 0 or 1 (measured: 11 finished steps lost)."""
    import json
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.run", "conf=smoke", f"run_root={tmp_path}",
                             "runner.max_steps=200", "runner.save_interval=200", "runner.val_check_interval=200"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        steps, deadline = 0, time.monotonic() + 300
        while steps < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            events = list(tmp_path.glob("smoke/*/perf/events.jsonl"))
            if events:
                lines = events[0].read_text().splitlines()
                steps = sum(1 for ln in lines if ln.endswith("}") and json.loads(ln).get("kind") == "step")
        assert steps >= 2, "".join(out)
        os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(10)
    text = "".join(out)
    assert rc == 130, text
    assert "lost during step" not in text and "rolled back" not in text, text
    m = re.search(r"interrupted \(SIGTERM\) at step (\d+): checkpointed", text)
    assert m is not None and int(m.group(1)) >= steps, text
    assert list(tmp_path.glob(f"smoke/*/checkpoints/global_step_{m.group(1)}"))


def test_an_interrupt_before_the_commands_handlers_is_one_line_and_exit_130(capsys):
    """A Ctrl-C while a command still imports or loads its config (no handler of its own yet) reaches
    `pipelines.cli.entry`: one line `interrupted`, exit 130, no traceback; every command's __main__ goes through it."""
    from pipelines.cli import entry

    def main():
        raise KeyboardInterrupt
    assert entry(main) == 130
    err = capsys.readouterr().err
    assert err == "interrupted\n"
    assert entry(lambda: 3) == 3
    for name in ("compare", "eval", "perf", "record", "replay", "run", "validate"):
        src = (REPO / "pipelines" / f"{name}.py").read_text()
        assert "sys.exit(entry(main))" in src, name


def test_a_ctrl_c_that_a_library_swallows_while_the_config_loads_still_interrupts(monkeypatch, capsys):
    """trimesh (imported with ManiSkill by the config check) wraps its optional imports in `except BaseException`:
    a Ctrl-C landing there raised a KeyboardInterrupt that vanished and the run went on. The entry's handler
    records it; `load` raises it again after loading (one line, exit 130), and a run's graceful stop, entered
    later, takes it as its first Ctrl-C."""
    import io
    import os
    import signal
    import time

    import pipelines.config
    from pipelines import cli
    from pipelines.run import graceful_stop

    def swallowing_load_config(overrides, **kw):
        try:  # what trimesh does around `from . import voxel`
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except BaseException:
            pass
        return object(), None
    monkeypatch.setattr(pipelines.config, "load_config", swallowing_load_config)
    before = signal.getsignal(signal.SIGINT)
    assert cli.entry(lambda: 0 if cli.load([]) is not None else 2) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # the entry's handler is gone with it
    assert cli.entry(lambda: 0 if cli.load([]) is not None else 2) == 130  # each entry starts clean
    capsys.readouterr()
    monkeypatch.setattr(pipelines.config, "load_config", lambda overrides, **kw: (object(), None))
    assert cli.entry(lambda: 0 if cli.load([]) is not None else 2) == 0  # no Ctrl-C: no interrupt

    class Runner:
        stop_requested = None

        def request_stop(self, reason):
            self.stop_requested = reason
    monkeypatch.setattr(cli, "_interrupted", ["SIGINT"])
    runner, out = Runner(), io.StringIO()
    with graceful_stop(runner, out=out):
        assert runner.stop_requested == "SIGINT"
    assert "SIGINT: stopping after the step in flight" in out.getvalue()


def test_validate_answers_runner_resume_as_run_does(tmp_path, capsys):
    """`pipelines.validate` refuses a `runner.resume` that `pipelines.run` would refuse before its cluster starts
    (the same `resolve_resume`), with the same one-line error."""
    from pipelines import validate
    (tmp_path / "smoke").mkdir()
    assert validate.main(["conf=smoke", f"run_root={tmp_path}", "runner.resume=doesnotexist"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: runner.resume='doesnotexist'") and err.count("\n") == 1, err
    assert validate.main(["conf=smoke", f"run_root={tmp_path}", "runner.resume=latest"]) == 2
    assert "no run of experiment smoke" in capsys.readouterr().err
    assert validate.main(["conf=smoke", f"run_root={tmp_path}"]) == 0


def test_resume_refuses_a_checkpoint_past_runner_max_steps(tmp_path, capsys):
    """Resuming a run whose checkpoint is beyond `runner.max_steps` is refused offline (run and validate alike),
    naming the step and both fixes; at exactly max_steps the resume is allowed (the final eval and checkpoint)."""
    import dataclasses

    from pipelines import validate
    from pipelines.runner.setup import RunState
    from storage.checkpoints import save_checkpoint
    run_dir = tmp_path / "smoke" / "20261204-000000-abcd"
    state = dataclasses.asdict(RunState(run_id=run_dir.name, cursors=[None]))
    state["step"] = 5
    save_checkpoint(run_dir, 5, {"run": {"runner": state}})
    assert validate.main(["conf=smoke", f"run_root={tmp_path}", f"runner.resume={run_dir.name}",
                          "runner.max_steps=3", "env.num_shards=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: runner.max_steps=3") and "at step 5 already" in err and "above 5" in err, err
    assert "pipelines.eval" in err and err.count("\n") == 1
    # at exactly max_steps, its final eval not recorded: allowed, and validate names what the resume would use
    assert validate.main(["conf=smoke", f"run_root={tmp_path}", f"runner.resume={run_dir.name}",
                          "runner.max_steps=5", "env.num_shards=1"]) == 0
    out = capsys.readouterr().out
    assert f"  resume: run {run_dir.name} from {run_dir / 'checkpoints' / 'global_step_5'} (step 5; " in out, out


def test_runner_lines_printed_under_the_progress_bar_start_on_a_cleared_line(capsys):
    """Runner.echo while the bar is up (a lost worker, a stop request, an eval line): the bar's line is cleared
    first and the bar redrawn after, so the message does not continue the bar's line (a fresh-clone check saw
    '...success=0.00]dagrl: worker(s) [...] lost during step 2; retrying')."""
    from types import SimpleNamespace

    from tqdm import tqdm

    from pipelines.runner import Runner
    fake = SimpleNamespace(_bar=None)
    say = Runner._bar_safe(fake, lambda line: print(line, file=sys.stderr))
    say("before the bar")
    fake._bar = tqdm(total=5, desc="bar", file=sys.stderr, ncols=60)
    fake._bar.update(2)
    say("dagrl: worker(s) lost during step 3; retrying")
    fake._bar.close()
    err = capsys.readouterr().err
    assert err.startswith("before the bar\n")
    head, line, _ = err.partition("dagrl: worker(s) lost during step 3; retrying\n")
    assert line and "bar:" in head and head.endswith("\r")  # the bar's line was cleared: the message starts a line


def test_quiet_keeps_mlflow_store_creation_silent(tmp_path):
    """MLflow resets its logger to INFO when imported, after `quiet()`: the first run on a new store printed two
    INFO lines ("Creating initial MLflow database tables...") that the README's sample output does not have."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from pipelines.cli import quiet; quiet(); "
            "from storage.tracking import Tracker; Tracker(uri=sys.argv[2], experiment='x', run_name='r')")
    res = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[2]),
                          f"sqlite:///{tmp_path / 'mlflow.db'}"], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "MLFLOW_LOGGING_LEVEL"})
    assert res.returncode == 0, res.stderr
    assert "INFO" not in res.stderr and "Creating initial" not in res.stderr, res.stderr


def test_a_sigterm_before_the_commands_handlers_is_one_line_and_exit_130():
    """SIGTERM while a command imports or loads its config (before `with_cluster`'s handler) killed the process
    silently with exit 143; the entry takes it as it takes a Ctrl-C."""
    code = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); from pipelines.cli import entry\n"
            "def main():\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n    return 0\n"
            "rc = entry(main)\nassert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\nsys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 130 and res.stderr == "interrupted\n", (res.returncode, res.stderr)


def test_a_ctrl_c_python_cannot_raise_is_recorded_not_printed(capsys, monkeypatch):
    """A KeyboardInterrupt of the entry's handler inside a gc callback (distributed's GCDiagnosis)
    is "unraisable": Python printed it with a traceback and went on. Under `entry` it is recorded and quiet, and
    the next check_interrupted stops the command (exit 130, one line); another unraisable error still prints."""
    import gc

    class Interrupts:
        def __del__(self):
            cli._on_interrupt(signal.SIGINT, None)  # what the SIGINT handler does when the signal lands here

    class Fails:
        def __del__(self):
            raise ValueError("not an interrupt")

    def main():
        Fails()
        gc.collect()
        Interrupts()
        gc.collect()
        cli.check_interrupted()
        return 0

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(type(u.exc_value).__name__))
    monkeypatch.setattr(cli, "_interrupted", [])  # this process's record of Ctrl-Cs, not left set for other tests
    assert cli.entry(main) == 130
    assert reported == ["ValueError"]  # passed on to the hook in place; the KeyboardInterrupt was not
    assert capsys.readouterr().err == "interrupted\n"


@pytest.mark.parametrize("after_ctrl_c", [True, False])
def test_an_error_a_library_made_of_a_ctrl_c_is_an_interrupt(after_ctrl_c, monkeypatch, capsys):
    """A Ctrl-C the entry's handler took, which a library (a database driver, a comm) turned into its own error
    on the way out of a command's cluster, ends the command as interrupted (exit 130, one line); the same error
    without a Ctrl-C before it stays an error (raised, the cluster closed)."""
    import pipelines.clusters
    handle = _Handle()
    monkeypatch.setattr(pipelines.clusters, "start_cluster", lambda cfg: handle)
    monkeypatch.setattr(cli, "_interrupted", [])

    def body(h):
        if after_ctrl_c:
            cli._interrupted.append("SIGINT")  # what the entry's SIGINT handler records before it raises
        raise RuntimeError("wrapped")

    capsys.readouterr()
    def main():
        return cli.with_cluster(None, body)

    if after_ctrl_c:
        assert cli.entry(main) == 130
        assert capsys.readouterr().err == "interrupted (RuntimeError after the Ctrl-C)\n"
    else:
        with pytest.raises(RuntimeError, match="wrapped"):
            cli.entry(main)
    assert handle.closed
