"""benchmarks/recipe.py: the table from fake eval records, and the stage logic (commands, record once per teacher,
skipping complete stages, resume of a started one, refusing changed overrides) with a fake CLI launcher. No real
runs, ~2 s."""
import json
from pathlib import Path

import pytest

from storage.checkpoints import save_checkpoint
from tasks.evalstats import compare_evals, episode_outcomes, fmt_gain, fmt_rate, wilson_interval, write_eval



@pytest.fixture(scope="module")
def recipe(load_benchmark):
    return load_benchmark("recipe")


def _outcomes(succ, base=1_000_000):
    return episode_outcomes([{"seed": base + i, "success_once": bool(s), "success_at_end": False, "return": 0.0,
                              "episode_len": 50} for i, s in enumerate(succ)])


EXTRA = {"eval_seed": 1_000_000, "eval_layout": {"num_envs": 10, "num_shards": 1, "device": "cpu"}}  # the runner's


def _records(tmp_path, name, evals: dict[int, list[int]]):
    d = tmp_path / name
    for step, succ in evals.items():
        write_eval(d, step, _outcomes(succ), EXTRA)
    from tasks.evalstats import read_evals
    return read_evals(d)


N = 48
S0 = [1] * 20 + [0] * 28  # 20/48
S4 = [1] * 24 + [0] * 24  # the 20 plus 4 more
S8 = [1] * 18 + [0] * 30  # two of the 20 lost


def test_summarize_row(recipe, tmp_path):
    sft = _records(tmp_path, "sft", {10: [1] * 10 + [0] * 38, 30: S0})
    rl = _records(tmp_path, "rl", {0: S0, 4: S4, 8: S8})
    row = recipe.summarize("A", 1, sft, rl, {"record": 69.0, "sft": 293.0, "rl": 1505.0})
    assert row["sft"]["step"] == 30 and row["sft"]["rate"] == pytest.approx(20 / N) and row["sft"]["n"] == N
    assert (row["sft"]["low"], row["sft"]["high"]) == wilson_interval(20, N)
    assert [e["step"] for e in row["rl_evals"]] == [0, 4, 8]
    assert [e["rate"] for e in row["rl_evals"]] == pytest.approx([20 / N, 24 / N, 18 / N])
    assert row["best"]["step"] == 4
    c_last = compare_evals(rl[8]["episodes"], rl[0]["episodes"])
    c_best = compare_evals(rl[4]["episodes"], rl[0]["episodes"])
    assert row["gain_last"] == {"vs": "rl", "vs_step": 0, "step": 8, "diff": c_last.diff, "low": c_last.low, "high": c_last.high,
                                "n": N}
    assert row["gain_best"]["diff"] == pytest.approx(4 / N) and row["gain_best"]["low"] == c_best.low
    assert row["gain_last"]["diff"] == pytest.approx(-2 / N)
    json.dumps(row)  # JSON-able
    # ties: the first step reaching the best rate; one RL eval only: no gain
    tie = recipe.summarize("A", 1, {}, _records(tmp_path, "tie", {0: S4, 4: S0, 8: S4}), {})
    assert tie["best"]["step"] == 0 and tie["sft"] is None
    one = recipe.summarize("A", 1, sft, _records(tmp_path, "one", {0: S0}), {})
    assert one["gain_last"] is None and one["best"]["step"] == 0


def test_summarize_pairs_with_the_sft_eval_without_a_step0_eval(recipe, tmp_path):
    """runner.val_at_start=false: the gain pairs the RL evals with the SFT run's eval of the checkpoint RL started
    from (step 30 here, not its last eval 40), only when it ran on the same episodes."""
    sft = _records(tmp_path, "sft", {30: S0, 40: S8})
    rl = _records(tmp_path, "rl", {6: S8, 12: S4})
    row = recipe.summarize("A", 1, sft, rl, {}, sft_step=30)
    c = compare_evals(rl[12]["episodes"], sft[30]["episodes"])
    assert row["gain_last"] == {"vs": "sft", "vs_step": 30, "step": 12, "diff": c.diff, "low": c.low,
                                "high": c.high, "n": N}
    assert row["gain_last"]["diff"] == pytest.approx(4 / N)
    assert row["gain_best"]["step"] == 12
    # a step-0 RL eval is preferred; without sft_step, the RL run's first eval
    assert recipe.summarize("A", 1, sft, _records(tmp_path, "rl0", {0: S8, 12: S4}), {}, sft_step=30)[
        "gain_last"]["vs"] == "rl"
    nostep = recipe.summarize("A", 1, sft, rl, {})
    assert (nostep["gain_last"]["vs"], nostep["gain_last"]["vs_step"]) == ("rl", 6)
    # other episodes (another eval seed base): not paired with the SFT eval
    d = tmp_path / "sft_other"
    write_eval(d, 30, _outcomes(S0, base=2_000_000), EXTRA)
    from tasks.evalstats import read_evals
    assert recipe.summarize("A", 1, read_evals(d), rl, {}, sft_step=30)["gain_last"]["vs"] == "rl"
    assert recipe.model_step(["x", "policy.model_path=/r/sft/checkpoints/global_step_30/hf"]) == 30
    assert recipe.model_step(["policy.model_path=/some/hf_dir"]) is None


def test_summarize_picks_the_best_step_on_the_validation_split(recipe, tmp_path):
    """With the RL run's validation records the best step is the first of the highest validation rate, scored by
    the eval at that step (not the highest eval); the table marks it and says so under it."""
    rl = _records(tmp_path, "rl", {0: S0, 4: S4, 8: S8})
    d = tmp_path / "rl_val"
    for step, succ in {0: [1] * 5 + [0] * 5, 4: [1] * 6 + [0] * 4, 8: [1] * 8 + [0] * 2}.items():
        write_eval(d, step, _outcomes(succ, base=2_000_000), EXTRA, split="val")
    from tasks.evalstats import read_evals
    val = read_evals(d, "val")
    row = recipe.summarize("A", 1, {}, rl, {}, val_evals=val)
    assert row["best_on"] == "val" and row["best"]["step"] == 8 and row["best"]["rate"] == pytest.approx(18 / N)
    assert row["best"]["val_rate"] == pytest.approx(0.8)
    c = compare_evals(rl[8]["episodes"], rl[0]["episodes"])
    assert row["gain_best"]["step"] == 8 and row["gain_best"]["diff"] == pytest.approx(c.diff) == row["gain_last"]["diff"]
    # without validation records: the highest eval (step 4), as before
    assert recipe.summarize("A", 1, {}, rl, {})["best"]["step"] == 4
    assert recipe.summarize("A", 1, {}, rl, {}, val_evals={})["best_on"] == "eval"
    md = recipe.table_markdown([row])
    assert f"{fmt_rate(18 / N, *wilson_interval(18, N))} (8, val)" in md
    assert "picked on a validation split of other episodes" in md and "optimistic" not in md
    md2 = recipe.table_markdown([row, recipe.summarize("A", 2, {}, rl, {})])
    assert "(optimistic)" in md2 and "rows marked 'val'" in md2


def test_table_markdown(recipe, tmp_path):
    sft = _records(tmp_path, "sft", {30: S0})
    rows = [recipe.summarize("A", 1, sft, _records(tmp_path, "r1", {0: S0, 4: S4, 8: S4}), {"record": 69.4, "sft": 293.0,
                                                                                            "rl": 1505.2}),
            recipe.summarize("A", 2, sft, _records(tmp_path, "r2", {0: S0, 4: S8}), {"record": 69.4, "sft": None,
                                                                                  "rl": 10.0}),
            recipe.summarize("B", 1, sft, _records(tmp_path, "r3", {0: [0] * N, 4: [1] * 30 + [0] * 18}),
                             {"record": 1.0, "sft": 2.0, "rl": 3.0})]
    md = recipe.write_table(rows, tmp_path / "out", {"x": 1})
    lines = md.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head == ["teacher", "seed", "SFT", "RL step 0", "RL step 4", "RL step 8", "best (step)", "gain last",
                    "gain best", "wall record / SFT / RL (s)"]
    r1 = [c.strip() for c in lines[2].strip("|").split("|")]
    assert r1[:3] == ["A", "1", fmt_rate(20 / N, *wilson_interval(20, N))]
    assert r1[4] == r1[5] == fmt_rate(24 / N, *wilson_interval(24, N)) and r1[6] == f"{r1[4]} (4)"
    g = compare_evals(_outcomes(S4), _outcomes(S0))
    assert r1[7] == r1[8] == fmt_gain(g.diff, g.low, g.high) and r1[9] == "69 / 293 / 1505"
    r2 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert r2[5] == "—" and r2[9] == "69 / — / 10"  # no eval at step 8, an unknown wall time
    # summary: gains last +4/48, -2/48, +30/48; the third alone has its lower bound above 0
    summ = [x for x in lines if x.startswith("gain last")][0]
    mean = (4 - 2 + 30) / N / 3
    assert f"mean {mean:+.3f} over 3 runs" in summ and "lower bound > 0 in 1/3" in summ
    assert "48 fixed eval episodes" in md
    back = json.loads((tmp_path / "out" / "recipe.json").read_text())
    assert back["meta"] == {"x": 1} and len(back["rows"]) == 3 and (tmp_path / "out" / "recipe.md").read_text() == md


class FakeCLI:
    """Stands in for the three CLIs: writes what each would (the store; a run dir with eval records and a
    checkpoint), prints the run line, and records the commands. `fail` = set of stage names that exit 1 once after
    their run line (an interrupted stage)."""

    def __init__(self, tmp_path, fail=()):
        self.calls, self.fail, self.n = [], set(fail), 0
        self.tmp = tmp_path

    def __call__(self, cmd, log, on_line):
        self.calls.append(cmd)
        args = dict(a.split("=", 1) for a in cmd[3:] if "=" in a)
        if cmd[2] == "pipelines.record":
            Path(args["record.out"]).mkdir(parents=True)
            return 0
        stage = "sft" if args["conf"].endswith("_sft") else "rl"
        resume = args.get("runner.resume")
        self.n += 1
        run_id = resume or f"run{self.n}"
        run_dir = Path(args["run_root"]) / args["conf"] / run_id
        on_line(f"dagrl: run {run_id} | run dir {run_dir} | MLflow x (run y)")
        seed = int(args["seed"])
        save_checkpoint(run_dir, 30 if stage == "sft" else 0, {"run": {"step": 0}})
        if stage in self.fail:
            self.fail.discard(stage)
            return 1
        evals = {30: S0} if stage == "sft" else {0: S0, 4: S4 if seed == 1 else S8}
        for step, succ in evals.items():
            write_eval(run_dir, step, _outcomes(succ), EXTRA)
        if stage == "sft":
            (run_dir / "checkpoints" / "global_step_30" / "hf").mkdir()
        return 0


def test_recipe_stages_commands_and_resumability(recipe, tmp_path, capsys):
    fake = FakeCLI(tmp_path)
    rl = ["--rl", "runner.max_steps=8 algorithm.lr=1e-5", "--sft", "runner.max_steps=30"]
    (tmp_path / "teachers" / "tA").mkdir(parents=True)
    (tmp_path / "teachers" / "tB").mkdir(parents=True)
    r = recipe.make_recipe(recipe.parse_args(_argv(tmp_path, *rl)), launch=fake, echo=lambda s: None)
    rows = r.run()
    out = (tmp_path / "out").resolve()
    mods = [c[2] for c in fake.calls]
    assert mods.count("pipelines.record") == 2 and mods.count("pipelines.run") == 8  # record once per teacher
    rec = [c for c in fake.calls if c[2] == "pipelines.record"]
    assert f"record.out={out}/tA/demos.zarr" in rec[0] and f"record.teacher={tmp_path.resolve()}/teachers/tA" in rec[0]
    sft_calls = [c for c in fake.calls if "conf=pushcube_pi0_sft" in c]
    rl_calls = [c for c in fake.calls if "conf=pushcube_pi0_grpo" in c]
    assert len(sft_calls) == len(rl_calls) == 4
    from pipelines.config import load_config
    for c in fake.calls:
        assert f"run_root={out}/runs" in c
        record = "pipelines.record" in c
        # runs log to the recipe's MLflow store; record logs nothing there (it refuses tracking.uri as inert)
        assert (f"tracking.uri=sqlite:///{out}/runs/mlflow.db" in c) != record
        if record:  # the record command passes the recorder's own offline check path (schema, inert keys)
            load_config(c[3:], components=False, command="record", require_teacher=False)
    assert sft_calls[0][-1] == "runner.max_steps=30" and f"sft.store={out}/tA/demos.zarr" in sft_calls[0]
    assert rl_calls[0][-2:] == ["runner.max_steps=8", "algorithm.lr=1e-5"]
    # RL starts from the SFT run's newest checkpoint's hf dir, same seed
    sft_run = out / "runs" / "pushcube_pi0_sft" / "run1"
    assert f"policy.model_path={sft_run}/checkpoints/global_step_30/hf" in rl_calls[0] and "seed=1" in rl_calls[0]
    assert [(row["teacher"], row["seed"]) for row in rows] == [("tA", 1), ("tA", 2), ("tB", 1), ("tB", 2)]
    assert rows[0]["gain_last"]["diff"] == pytest.approx(4 / N) and rows[1]["gain_last"]["diff"] == pytest.approx(-2 / N)
    assert all(row["wall_s"]["rl"] is not None for row in rows)

    # a rerun: every stage complete, nothing launched; the table comes from the markers
    fake.calls.clear()
    assert recipe.main(_argv(tmp_path, *rl), launch=fake) == 0
    assert fake.calls == []
    printed = capsys.readouterr().out
    assert printed.count("| tA |") == 2 and "recipe.md" in printed
    # other RL overrides on a complete stage: refused (exit 2, one line) ...
    assert recipe.main(_argv(tmp_path, "--rl", "runner.max_steps=12", "--sft", "runner.max_steps=30"),
                       launch=fake) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--redo rl" in err and err.count("\n") == 1 and fake.calls == []
    # ... unless --redo rl: only the RL stages run again
    assert recipe.main(_argv(tmp_path, "--rl", "runner.max_steps=12", "--sft", "runner.max_steps=30", "--redo", "rl"),
                       launch=fake) == 0
    assert len(fake.calls) == 4 and all("conf=pushcube_pi0_grpo" in c and "runner.max_steps=12" in c
                                        for c in fake.calls)


def _argv(tmp_path, *extra):
    return ["--teachers", str(tmp_path / "teachers" / "tA"), str(tmp_path / "teachers" / "tB"), "--seeds", "1", "2",
            "--out", str(tmp_path / "out"), *extra]


def test_recipe_resumes_an_interrupted_stage(recipe, tmp_path):
    fake = FakeCLI(tmp_path, fail={"rl"})  # the RL run starts, writes a checkpoint, then exits 1
    (tmp_path / "teachers" / "tA").mkdir(parents=True)
    argv = ["--teachers", str(tmp_path / "teachers" / "tA"), "--seeds", "1", "--out", str(tmp_path / "out")]
    assert recipe.main(argv, launch=fake) == 1
    started = json.loads((tmp_path / "out" / "tA" / "seed1" / "rl.started.json").read_text())
    assert not (tmp_path / "out" / "tA" / "seed1" / "rl.json").exists()
    fake.calls.clear()
    assert recipe.main(argv, launch=fake) == 0
    assert len(fake.calls) == 1 and fake.calls[0][-1] == f"runner.resume={started['run_id']}"  # record, SFT skipped
    # an interrupted recording (store, no marker) is recorded again into a fresh store
    (tmp_path / "out" / "tA" / "record.json").unlink()
    fake.calls.clear()
    assert recipe.main(argv, launch=fake) == 0
    assert [c[2] for c in fake.calls] == ["pipelines.record"]


def test_recipe_stop_after_runs_the_earlier_stages_only(recipe, tmp_path):
    fake = FakeCLI(tmp_path)
    (tmp_path / "teachers" / "tA").mkdir(parents=True)
    (tmp_path / "teachers" / "tB").mkdir(parents=True)
    assert recipe.main(_argv(tmp_path, "--stop-after", "record"), launch=fake) == 0
    assert [c[2] for c in fake.calls] == ["pipelines.record"] * 2
    fake.calls.clear()
    assert recipe.main(_argv(tmp_path, "--stop-after", "sft"), launch=fake) == 0
    assert len(fake.calls) == 4 and all("conf=pushcube_pi0_sft" in c for c in fake.calls)  # records kept
    fake.calls.clear()
    assert recipe.main(_argv(tmp_path), launch=fake) == 0  # the same --out goes on with the RL stages only
    assert len(fake.calls) == 4 and all("conf=pushcube_pi0_grpo" in c for c in fake.calls)


def test_stage_wall_is_the_runs_elapsed_time_across_resumes(recipe, tmp_path):
    """A resumed stage's marker holds only its last invocation's wall; the table takes the runner's elapsed time
    from the latest checkpoint (summed over resumes), and the marker's wall when no checkpoint says."""
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, 6, {"run": {"runner": {"step": 6, "elapsed_s": 800.0}}})
    save_checkpoint(run_dir, 12, {"run": {"runner": {"step": 12, "elapsed_s": 1500.0}}})
    assert recipe.stage_wall({"run_dir": str(run_dir), "wall_s": 700.0}) == 1500.0
    assert recipe.stage_wall({"run_dir": str(tmp_path / "none"), "wall_s": 700.0}) == 700.0
    assert recipe.stage_wall({"run_dir": None, "wall_s": None}) is None


def test_recipe_argument_errors(recipe, tmp_path, capsys, monkeypatch):
    (tmp_path / "t").mkdir()
    monkeypatch.setitem(recipe.FAMILIES, "token", ("no_such_token_sft", "no_such_token_grpo"))  # a family's confs missing
    for argv, needle in [(["--family", "token"], "--sft-conf=no_such_token_sft"),
                         (["--rl-conf", "nope"], "--rl-conf=nope"),
                         (["--rl", "runner.max_steps"], "not a k=v override"),
                         (["--seeds", "1", "1"], "repeated")]:
        fake = FakeCLI(tmp_path)  # never a real CLI, whatever the arguments
        assert recipe.main(["--teachers", str(tmp_path / "t"), "--out", str(tmp_path / "o"), *argv], launch=fake) == 2
        assert fake.calls == []
        err = capsys.readouterr().err
        assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
    assert recipe.main(["--teachers", str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
                       launch=FakeCLI(tmp_path)) == 2
    assert "not a run directory" in capsys.readouterr().err
    # --rl-conf pushcube_pi0_ppo is accepted (an existing conf)
    fake = FakeCLI(tmp_path)
    assert recipe.main(["--teachers", str(tmp_path / "t"), "--out", str(tmp_path / "o"), "--rl-conf",
                        "pushcube_pi0_ppo", "--dry-run"], launch=fake) == 0
    assert fake.calls == [] and "conf=pushcube_pi0_ppo" in capsys.readouterr().out


def test_recipe_rl_arms_share_record_and_sft(recipe, tmp_path, capsys):
    """Two RL variants on one --out: the second arm runs only its RL stages, from the very SFT checkpoints of the
    first; each arm has its own markers, logs and table, and refuses a changed command on its own."""
    fake = FakeCLI(tmp_path)
    (tmp_path / "teachers" / "tA").mkdir(parents=True)
    (tmp_path / "teachers" / "tB").mkdir(parents=True)
    assert recipe.main(_argv(tmp_path, "--rl-arm", "grpo"), launch=fake) == 0
    out = tmp_path / "out"
    assert len(fake.calls) == 2 + 4 + 4
    assert "logs/tA_seed1_rl_grpo.log" in capsys.readouterr().out  # the arm's own log
    grpo_rl = [c for c in fake.calls if "conf=pushcube_pi0_grpo" in c]
    fake.calls.clear()
    assert recipe.main(_argv(tmp_path, "--rl-arm", "ppo", "--rl-conf", "pushcube_pi0_ppo"), launch=fake) == 0
    assert len(fake.calls) == 4 and all("conf=pushcube_pi0_ppo" in c for c in fake.calls)  # record, SFT reused
    model = lambda c: next(a for a in c if a.startswith("policy.model_path="))  # noqa: E731
    assert [model(c) for c in fake.calls] == [model(c) for c in grpo_rl]  # the same SFT checkpoints
    for arm in ("grpo", "ppo"):
        assert (out / "tA" / "seed1" / f"rl_{arm}.json").is_file()
        assert (out / "tB" / "seed2" / f"rl_{arm}.started.json").is_file()
        assert len(json.loads((out / f"recipe_{arm}.json").read_text())["rows"]) == 4
    assert not (out / "tA" / "seed1" / "rl.json").exists() and not (out / "recipe.md").exists()
    assert json.loads((out / "recipe_ppo.json").read_text())["meta"]["rl_arm"] == "ppo"
    capsys.readouterr()
    # a changed command on a complete arm is refused, naming that arm's marker; the other arm is untouched
    fake.calls.clear()
    assert recipe.main(_argv(tmp_path, "--rl-arm", "ppo", "--rl-conf", "pushcube_pi0_ppo", "--rl",
                             "runner.max_steps=3"), launch=fake) == 2
    assert "rl_ppo.json" in capsys.readouterr().err and fake.calls == []
    assert recipe.main(_argv(tmp_path, "--rl-arm", "grpo", "--table-only"), launch=fake) == 0
    assert fake.calls == [] and "recipe_grpo.md" in capsys.readouterr().out
    # a name that cannot name a file is refused before anything runs
    assert recipe.main(_argv(tmp_path, "--rl-arm", "a/b"), launch=fake) == 2
    assert "--rl-arm" in capsys.readouterr().err and fake.calls == []
