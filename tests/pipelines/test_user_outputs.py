"""What a new user reads from the commands, tested on the functions that write it (unit tier, derived values): the
done line and the perf table say what they count (this session / the whole run), an SFT run's throughput without
an env line, the progress bar without `nan`, the dashboard's port fallback said, the replay note of a store with
no complete episode, `--help` listing the experiments and groups, `--show` of an experiment that leaves required
keys `???`, a closed stdout pipe, and `run_root=DIR` (and the older `--run-root DIR`) on every command."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import cli, compare, perf, record, replay, run, validate
from pipelines import eval as eval_cli
from pipelines.runner.perf import format_table, summarize

REPO = Path(__file__).resolve().parents[2]


def _call(capsys, main, *argv) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


# ----- the end-of-run summaries -----

def test_the_done_line_counts_this_session_and_names_it():
    # a new run: its one session is the whole run
    assert run.session_text(3, 120, 77.4) == "step 3 | this session: steps 1-3 (3), 120 env steps in 77 s"
    # a resume from the checkpoint of step 16 (2560 env steps) that trained to step 26: 10 steps, 1600 env steps
    text = run.session_text(26, 4160, 128.2, start_step=16, start_env_steps=2560)
    assert text.startswith("step 26 | this session: steps 17-26 (10), 1600 env steps in 128 s")
    assert text.endswith("the perf table above is the whole run's")
    assert "step 5 (1)" in run.session_text(5, 50, 3.0, start_step=4, start_env_steps=40)
    assert "no training step (the checkpoint was at step 26) in 9 s" in run.session_text(26, 4160, 9.0, 26, 4160)
    assert run.session_text(2, 0, 37.0) == "step 2 | this session: steps 1-2 (2) in 37 s"  # SFT: no env steps


def _step(n, *, env_steps, samples, update_s=0.5, wall=3.0):
    return {"kind": "step", "step": n, "attempt": 0, "wall_s": wall, "path": {"update": update_s},
            "busy": {"update": update_s}, "overhead_s": wall - update_s, "overlap_s": 0.0, "env_steps": env_steps,
            "rollout_s": 1.0 if env_steps else 0.0, "update_s": update_s, "samples": samples, "epochs": 1.0,
            "tasks": 3, "t": 0}


def test_the_perf_table_says_it_is_the_whole_run_over_its_sessions():
    ev = [{"kind": "session", "t": 0.0}, _step(1, env_steps=40, samples=40),
          {"kind": "session_end", "wall_s": 57.3, "t": 60.0},
          {"kind": "session", "t": 100.0}, _step(2, env_steps=40, samples=40),
          {"kind": "session_end", "wall_s": 128.5, "t": 230.0}]
    head = format_table(summarize(ev)).splitlines()[0]
    walls = 57.3 + 128.5  # the run wall: the sum of the sessions' walls (pipelines.runner.perf's definition)
    assert head == f"perf, whole run (2 sessions): 2 step(s) in {walls:.1f} s of run wall, the sessions' walls summed"
    one = format_table(summarize(ev[:3])).splitlines()[0]
    assert one == "perf, whole run (1 session): 1 step(s) in 57.3 s of run wall"


def test_an_sft_run_reports_its_update_throughput_and_no_env_line():
    """SFT steps have no env steps: no `env steps/s - (rollout), 0 (step wall)`; their samples are the minibatch
    updates x sft.batch_size (PerfRecorder's sft_batch_size), not 0."""
    ev = [{"kind": "session", "t": 0.0}, _step(1, env_steps=0, samples=25 * 64, update_s=2.0),
          _step(2, env_steps=0, samples=25 * 64, update_s=2.0), {"kind": "session_end", "wall_s": 10.0, "t": 10}]
    s = summarize(ev)
    table = format_table(s)
    assert "env steps/s" not in table
    assert f"  update samples/s {2 * 25 * 64 / 4.0:.0f}" in table.splitlines()


def test_the_perf_recorder_counts_an_sft_steps_samples():
    from pipelines.runner.perf import PerfRecorder
    rec = PerfRecorder.__new__(PerfRecorder)  # its step accounting only: no cluster
    rec.samples_per_step, rec.sft_batch_size, rec.colocated = 4 * 10, 64, True
    written = []
    rec.poll, rec._take, rec._other_busy = (lambda: None), (lambda deps: {}), (lambda phases: {})
    rec._write = written.append

    class _Graph:
        dependencies = {}
    rec.step(1, _Graph(), {}, {"time/step": 3.0, "time/update": 2.0, "train/minibatch_updates": 23.0},
             env_steps=0, attempt=0)
    rec.step(2, _Graph(), {}, {"time/step": 3.0, "time/update": 0.5, "time/rollout_total_max": 1.0},
             env_steps=40, attempt=0)
    assert [e["samples"] for e in written] == [23 * 64, 4 * 10]  # SFT: updates x sft.batch_size; RL: the batch


def test_the_progress_bar_shows_a_dash_when_no_training_episode_ended():
    from pipelines.runner.loop import progress_postfix
    rl = {"rollout/env_steps_per_s": 123.4}  # a step shorter than an episode: no env/success_once
    assert progress_postfix(rl, None) == {"env_sps": "123", "success": "-"}
    assert progress_postfix({**rl, "env/success_once": 0.25}, {"eval/success_once": 0.5}) == \
        {"env_sps": "123", "success": "0.25", "eval": "0.50"}
    assert progress_postfix({**rl, "env/success_once": math.nan}, None)["success"] == "-"
    assert progress_postfix({"train/sft_loss": 0.1234}, None) == {"loss": "0.123"}


def test_a_dashboard_that_falls_back_from_a_busy_port_says_so():
    from pipelines.clusters.local import dashboard_note
    note = dashboard_note("127.0.0.1:8787", "http://127.0.0.1:41234/status")
    assert note.startswith("dashboard on port 41234: port 8787 (cluster.dashboard_address=127.0.0.1:8787) is taken")
    assert dashboard_note(":8787", "http://10.0.0.1:8787/status") is None  # where it was asked
    assert dashboard_note("127.0.0.1:0", "http://127.0.0.1:41234/status") is None  # any port was asked


def test_the_replay_note_of_a_store_with_no_complete_episode():
    """The smoke run: 3 training steps of rollout.chunk_steps=10 (1 action each) against PushCube's 50-step
    episodes: none complete; the note says how long an episode is, what the store holds, and how to get either."""
    from storage.episodes import no_complete_note
    note = no_complete_note("PushCube-v1", 50, 1, 3, 10, [0, 1, 2, 3])
    assert "a PushCube-v1 episode lasts up to 50 env steps (50 chunk steps of 1 action(s))" in note
    assert "the store holds 30 chunk steps per env (3 training step(s) of rollout.chunk_steps=10)" in note
    assert "--episodes IDS picks any of ids 0-3" in note
    assert "runner.max_steps x rollout.chunk_steps >= 50" in note
    # chunks of 5 actions: ceil(50 / 5) = 10 chunk steps; a 52-step episode needs ceil(52 / 5) = 11
    assert "(10 chunk steps of 5 action(s))" in no_complete_note("PushCube-v1", 50, 5, 1, 4, [0])
    assert "(11 chunk steps of 5 action(s))" in no_complete_note("X", 52, 5, 1, 4, [0, 2, 3])


# ----- --help, --show -----

@pytest.mark.parametrize("name", ["run", "validate", "record"])
def test_help_lists_every_experiment_and_every_groups_options(name, capsys):
    main = {"run": run.main, "validate": validate.main, "record": record.main}[name]
    rc, out, err = _call(capsys, main, "--help")
    assert rc == 0 and err == []
    lines = out.splitlines()
    for exp in (REPO / "conf" / "conf").glob("*.yaml"):
        (line,) = [ln for ln in lines if ln.startswith(f"  {exp.stem} ")]
        assert ("needs policy.model_path=..." in line) == ("???" in exp.read_text())
    for group in ("env", "policy", "algorithm", "rollout", "runner", "sft", "cluster"):
        options = sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml") if not p.stem.startswith("_"))
        listed = " ".join(ln.strip() for ln in lines[lines.index(next(ln for ln in lines
                                                                     if ln.startswith(f"  {group} "))):])
        assert ", ".join(options) in listed.split(group, 1)[1], (group, options)
    assert "(default)" in next(ln for ln in lines if ln.startswith("  pushcube_ppo "))


def test_show_of_an_experiment_with_a_required_key_shows_it_marked(capsys):
    import yaml
    rc, out, err = _call(capsys, run.main, "conf=pushcube_pi0_grpo", "--show")
    assert rc == 0
    shown = yaml.safe_load(out)
    assert shown["policy"]["model_path"] == "???" and shown["experiment"] == "pushcube_pi0_grpo"
    assert out.splitlines()[0].startswith("#") and "policy.model_path" in out.splitlines()[0]
    assert err == [next(e for e in err if e.startswith("note: policy.model_path=??? is required and not given"))]
    # given, it is shown as given, with nothing marked
    rc, out, err = _call(capsys, run.main, "conf=pushcube_pi0_grpo", "policy.model_path=null", "--show")
    assert rc == 0 and "???" not in out and err == []
    # validate --show shows it too, then refuses it (a config that cannot run is not valid): exit 2, one error
    rc, out, err = _call(capsys, validate.main, "conf=pushcube_pi0_grpo", "--show")
    assert rc == 2 and yaml.safe_load(out)["policy"]["model_path"] == "???"
    assert len(err) == 1 and err[0].startswith("error: policy.model_path='???'")


# ----- a closed pipe -----

def test_a_closed_stdout_pipe_ends_a_command_quietly(tmp_path):
    """`... | head`: the reader goes away while the command writes; no traceback, no "Exception ignored", exit 141
    (a shell's code for a command stopped by a closed pipe). The command writes more than a pipe holds (64 KiB),
    so the pipe is closed while it writes, whatever the timing."""
    code = ("import sys; from pipelines.cli import entry; "
            "sys.exit(entry(lambda: print('x' * 100 + '\\n') or [print('y' * 100) for _ in range(5000)] and 0))")
    p = subprocess.run(f"{sys.executable} -c \"{code}\" | head -c 10 >/dev/null; exit ${{PIPESTATUS[0]}}",
                       shell=True, executable="/bin/bash", cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.stderr == "" and p.returncode == 141, (p.returncode, p.stderr)


# ----- run_root=DIR, the one spelling (--run-root DIR kept) -----

def test_the_shared_keys_are_rewritten_both_ways():
    assert cli.as_overrides(["conf=smoke", "--run-root", "/r", "--tracking-uri=http://h:1"], "p") == \
        ["conf=smoke", "run_root=/r", "tracking.uri=http://h:1"]
    assert cli.as_flags(["RUN", "run_root=/r", "tracking.uri=http://h:1", "--json"]) == \
        ["RUN", "--run-root", "/r", "--tracking-uri", "http://h:1", "--json"]
    assert cli.as_flags(["RUN", "tracking.uri=x"], ("run_root",)) == ["RUN", "tracking.uri=x"]  # not its key
    with pytest.raises(cli.UsageError, match="--run-root needs a value: run_root=VALUE"):
        cli.as_overrides(["--run-root"], "p")


def _both(capsys, main, *argv, root: Path):
    """The command's outcome with `run_root=ROOT` and with `--run-root ROOT`: (rc, out, err) of each."""
    return [_call(capsys, main, *argv, *spelling) for spelling in ([f"run_root={root}"], ["--run-root", str(root)])]


@pytest.mark.parametrize("name", ["run", "validate"])
def test_run_and_validate_take_both_spellings(name, capsys, tmp_path):
    main = {"run": run.main, "validate": validate.main}[name]
    for rc, out, err in _both(capsys, main, "conf=smoke", "--show", root=tmp_path / "r"):
        assert rc == 0 and f"run_root: {tmp_path / 'r'}" in out.splitlines()


def test_record_takes_both_spellings(capsys, tmp_path):
    """record looks its teacher's run id up under run_root: the same refusal, naming that root, either way."""
    res = _both(capsys, record.main, "conf=pushcube_record", "record.teacher=20260101-000000-none", root=tmp_path)
    assert res[0] == res[1] and res[0][0] == 2 and str(tmp_path) in res[0][2][0]


@pytest.mark.parametrize("name", ["eval", "replay", "perf"])
def test_eval_replay_and_perf_take_both_spellings(name, capsys, tmp_path):
    """A run id under ROOT: the same lookup (the same one-line refusal for an unknown id, naming ROOT)."""
    (tmp_path / "smoke" / "20260101-000000-abcd").mkdir(parents=True)
    main = {"eval": eval_cli.main, "replay": replay.main, "perf": perf.main}[name]
    res = _both(capsys, main, "20260101-000000-abce", root=tmp_path)
    assert res[0] == res[1] and res[0][0] == 2 and len(res[0][2]) == 1
    assert str(tmp_path) in res[0][2][0] and "20260101-000000-abcd" in res[0][2][0]  # the close match under ROOT


def test_compare_takes_both_spellings(capsys, tmp_path):
    res = _both(capsys, compare.main, "20260101-000000-abcd", root=tmp_path / "nowhere")
    assert res[0] == res[1] and res[0][0] == 2 and str(tmp_path / "nowhere" / "mlflow.db") in res[0][2][0]
