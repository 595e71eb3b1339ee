"""`python -m pipelines.eval` (pipelines/eval.py): the same evaluation as a training run's, on a checkpoint.

The check of substance: evaluating the suite's smoke run's step-3 checkpoint on the run's own eval episodes gives
exactly the outcomes the run's eval of those weights recorded (`evals/step_3.json`: the same deterministic
policy on the same reset seeds, here in a fresh cluster). Then the bad inputs, offline: one line, exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines.eval import EVAL_KEYS, main, per_task, resolve_source


def _run_dir(root: Path) -> Path:
    (run_dir,) = [p for p in (root / "smoke").iterdir() if p.is_dir()]
    return run_dir


def test_eval_of_a_checkpoint_reproduces_the_runs_own_eval(smoke_run, capsys):
    from mlflow.tracking import MlflowClient

    from storage.tracking import default_tracking_uri
    from tasks.evalstats import fmt_rate, read_evals, wilson_interval
    run_dir = _run_dir(smoke_run)
    ckpt = run_dir / "checkpoints" / "global_step_3"
    assert main([str(ckpt), f"run_root={smoke_run}", "runner.eval_videos=0"]) == 0
    out = capsys.readouterr().out
    (d,) = list((run_dir / "external_evals").iterdir())
    assert d.name == "global_step_3-seed1000000-n2"
    rec = json.loads((d / "eval.json").read_text())
    own = read_evals(run_dir)[3]["episodes"]
    assert list(rec["episodes"]) == list(own)  # the same fixed episodes
    for seed, o in own.items():
        got = rec["episodes"][seed]
        assert (got["success_once"], got["success_at_end"], got["episode_len"]) == \
               (o["success_once"], o["success_at_end"], o["episode_len"])
        assert got["return"] == pytest.approx(o["return"], abs=1e-6)
    k = sum(o["success_once"] for o in own.values())
    assert rec["step"] == 3 and rec["summary"]["success_once"] == k / 2
    assert fmt_rate(k / 2, *wilson_interval(k, 2), 2) in out and str(d) in out
    # MLflow: a run in experiment smoke-eval holding the rates at the checkpoint's step, and eval.json
    client = MlflowClient(default_tracking_uri(smoke_run))
    (run,) = client.search_runs([client.get_experiment_by_name("smoke-eval").experiment_id])
    assert run.data.tags["dagrl.eval_of"] == str(ckpt) and run.data.metrics["eval/success_once"] == k / 2
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/success_once")] == [3]
    assert "eval.json" in [f.path for f in client.list_artifacts(run.info.run_id)]  # the output dir's files
    # a second eval of the same checkpoint never overwrites the first: the source resolves, the dir is new
    from pipelines.eval import eval_config, output_dir
    src = resolve_source(str(run_dir), str(smoke_run))  # the run: its best checkpoint, else its newest
    assert src.checkpoint.name.startswith("global_step_")
    src3 = resolve_source(str(ckpt), "")
    assert output_dir(src3, eval_config(src3, []), None).name == "global_step_3-seed1000000-n2-2"


def test_eval_films_into_its_own_output_dir(smoke_run, tmp_path):
    """`runner.eval_videos=1`: the eval graph's video node writes into `<out>/videos`, which pipelines.eval makes
    (the node never creates directories: a run's removed directory must not come back through it)."""
    ckpt = _run_dir(smoke_run) / "checkpoints" / "global_step_3"
    out = tmp_path / "ev"
    assert main([str(ckpt), f"run_root={smoke_run}", "runner.eval_videos=1", "--out", str(out)]) == 0
    rec = json.loads((out / "eval.json").read_text())
    assert rec["video_error"] is None and rec["videos"] == [str(out / "videos" / "episode_0.mp4")]
    assert (out / "videos" / "episode_0.mp4").stat().st_size > 0


@pytest.mark.parametrize("words, key", [
    (["/no/such/run"], "source"),
    (["RUN", "env.num_envs=8"], "env.num_envs"),  # another env than the run's: refused
    (["RUN", "policy.hidden_sizes=[8]"], "policy.hidden_sizes"),
    (["RUN", "env.eval.num_episodes=0"], "env.eval.num_episodes"),  # an allowed key, a bad value
    (["RUN", "--out", "EXISTING"], "--out"),
    (["RUN", "oops"], "oops"),
    (["RUN", "--bogus"], "--bogus"),
    (["HF"], "conf"),  # an hf dir outside a run needs the experiment
])
def test_bad_input_is_one_line_and_exit_2(words, key, tmp_path, capsys):
    run = tmp_path / "runs" / "smoke" / "20261201-000000-abcd"
    (run / "checkpoints").mkdir(parents=True)
    from pipelines.config import load_config, to_yaml
    cfg, _ = load_config(["conf=smoke"], components=False)
    from storage.rundir import write_resolved_config
    write_resolved_config(run, to_yaml(cfg))  # with its digest, as a run writes it
    from storage.checkpoints import save_checkpoint
    save_checkpoint(run, 3, {"run": {"step": 3}})
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (tmp_path / "existing").mkdir()
    subst = {"RUN": str(run), "HF": str(hf), "EXISTING": str(tmp_path / "existing")}
    assert main([subst.get(w, w) for w in words]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and key in err, err


def test_eval_keys_and_per_task():
    assert "env.eval." in EVAL_KEYS and not any(k.startswith("policy") for k in EVAL_KEYS)
    eps = [{"seed": s, "task_id": s % 2, "success_once": s < 3, "success_at_end": False, "return": 0.0,
            "episode_len": 5} for s in range(6)]
    got = per_task(eps)
    assert list(got) == ["0", "1"]
    assert got["0"]["success_once"] == pytest.approx(2 / 3) and got["1"]["success_once"] == pytest.approx(1 / 3)
    assert per_task([{k: v for k, v in e.items() if k != "task_id"} for e in eps]) == {}


def test_damaged_checkpoint_is_one_line_before_anything_starts(tmp_path, capsys):
    """A checkpoint whose policy file no longer matches its index (sha256) is refused by the source check, exit 2
    with the file named (was: a worker traceback, exit 1)."""
    import torch

    from pipelines.config import load_config, to_yaml
    from storage.checkpoints import save_checkpoint
    from storage.rundir import write_resolved_config
    run = tmp_path / "runs" / "smoke" / "20261201-000000-abcd"
    (run / "checkpoints").mkdir(parents=True)
    cfg, _ = load_config(["conf=smoke"], components=False)
    write_resolved_config(run, to_yaml(cfg))
    ckpt = save_checkpoint(run, 3, {"run": {"step": 3}, "policy": {"w": torch.ones(64)}})
    f = ckpt / "policy.pt"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    for source in (run, ckpt):
        assert main([str(source)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: source") and "\n" not in err and "policy.pt is corrupt" in err, err


def test_eval_of_a_run_with_a_validation_split_plays_the_eval_only(smoke_run, tmp_path):
    """A run trained with env.eval.val_episodes > 0: pipelines.eval plays the eval's episodes only (its config
    drops the split), so an eval on the validation seeds (`env.eval.seed=<val_seed>`) is not refused as an
    overlap."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from pipelines.eval import eval_config
    saved = OmegaConf.load(_run_dir(smoke_run) / "config.yaml")
    saved.env.eval.val_episodes, saved.env.eval.val_seed = 200, 2_000_000
    from storage.rundir import write_resolved_config
    write_resolved_config(tmp_path / "run", OmegaConf.to_yaml(saved))
    cfg = eval_config(SimpleNamespace(hf=None, run_dir=tmp_path / "run"), ["env.eval.seed=2000000"])
    assert cfg.env.eval.seed == 2_000_000 and cfg.env.eval.val_episodes == 0


def test_the_protocols_episode_count_is_a_changed_copy_of_the_config(monkeypatch):
    """`protocol_defaults`: a simulator with an evaluation protocol (LIBERO: every (task, init state) pair) sets
    env.eval.num_episodes on a copy (the config is frozen), unless an override gives it; without a protocol the
    config comes back as it is. Offline, a stand-in for the simulator's count."""
    import tasks.envs
    from pipelines.eval import protocol_defaults
    from tasks.config import Config
    cfg = Config()
    n = cfg.env.eval.num_episodes + 7
    monkeypatch.setattr(tasks.envs, "protocol_episodes", lambda env: n)
    out = protocol_defaults(cfg, [])
    assert out.env.eval.num_episodes == n and cfg.env.eval.num_episodes == n - 7
    assert protocol_defaults(cfg, ["env.eval.num_episodes=3"]) is cfg
    monkeypatch.setattr(tasks.envs, "protocol_episodes", lambda env: None)
    assert protocol_defaults(cfg, []) is cfg
