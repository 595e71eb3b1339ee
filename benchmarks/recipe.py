"""The VLA recipe end to end, for teachers x seeds, with intervals: record -> SFT -> RL, one table.

    .venv/bin/python benchmarks/recipe.py --teachers runs/pushcube_ppo/<A> runs/pushcube_ppo/<B> --seeds 1 2 3 \
        --out runs/recipe [--family pi0|token] [--sft-conf NAME] [--rl-conf NAME] \
        [--record "k=v ..."] [--sft "k=v ..."] [--rl "k=v ..."] [--sft-checkpoint latest|best] \
        [--redo record|sft|rl] [--stop-after record|sft] [--rl-arm NAME] [--dry-run] [--table-only]

Per teacher (an existing PPO run dir, or a run id under the default run root), once:
    python -m pipelines.record conf=pushcube_record record.teacher=T record.out=OUT/<t>/demos.zarr ...
per (teacher, seed):
    python -m pipelines.run conf=<sft conf> sft.store=OUT/<t>/demos.zarr seed=S ...
    python -m pipelines.run conf=<rl conf> policy.model_path=<SFT run>/checkpoints/global_step_N/hf seed=S ...
each with `run_root=OUT/runs tracking.uri=sqlite:///OUT/runs/mlflow.db` and the stage's extra overrides (`--record`,
`--sft`, `--rl`: one string of space-separated Hydra overrides, applied last). `--family` picks the confs
(pi0: pushcube_pi0_sft / pushcube_pi0_grpo, and with `--sft "policy=pi05_tiny" --rl "policy=pi05_tiny"` π0.5;
token: pushcube_token_sft / pushcube_token_grpo), `--sft-conf` /
`--rl-conf` override them (e.g. `--rl-conf pushcube_pi0_ppo`). N is the SFT run's newest checkpoint
(`--sft-checkpoint best`: the one its best eval marked, `checkpoints/best`).

Resumable: a stage is complete once its marker `OUT/<t>/[seed<S>/]<stage>.json` exists (written after the CLI
exited 0 and its outputs were found: the store, the run dir with its eval records and checkpoint); a rerun skips
complete stages. A stage interrupted after its run started (the run line `dagrl: run ID | run dir ...` was seen,
`<stage>.started.json`) continues with `runner.resume=ID` when that run has a checkpoint, else starts again; an
incomplete record store is removed and recorded again. A complete stage whose command differs from the marker's
(other overrides) is refused with one line: use another `--out`, or `--redo STAGE` (that stage and the ones after
it are run again). `--stop-after STAGE` runs the stages up to STAGE only (e.g. every SFT checkpoint first, the RL
stages by a later call with the same `--out`). Every CLI's output goes to `OUT/logs/`.

RL arms: `--rl-arm NAME` keeps this RL stage's markers as `rl_NAME.json` (its log `..._rl_NAME.log`, its table
`OUT/recipe_NAME.md` / `.json`), so that several RL variants (another `--rl-conf`, other `--rl` overrides) start
from the very same recordings and SFT checkpoints of one `--out` and pair against the same SFT evals; each arm
is resumable and refuses a changed command on its own. Without it the RL stage is `rl.json` and the table
`recipe.md`, as before.

The table (printed, and written to OUT/recipe.md and OUT/recipe.json) reads each run's per-episode eval records
(`<run dir>/evals/step_N.json`, pipelines.runner): per (teacher, seed) the SFT run's last eval, the RL run's eval at
every eval step with its Wilson 95 % interval, the best RL eval, the gain of the last and of the best eval over the
RL run's step-0 eval (the SFT policy on the same fixed episodes; without one, `runner.val_at_start=false`, the SFT
run's eval of the checkpoint RL started from, when it ran on the same episodes: the same eval) with Newcombe's
paired 95 % interval
(tasks.evalstats), and the wall time of each stage (SFT and RL: the run's elapsed training time through its last
checkpoint, summed over resumes, start-up excluded; `stage_wall`). The best eval is picked on the same episodes it is
scored on, so its gain is optimistic; the last eval's is not; an RL run with a validation split (`--rl
"env.eval.val_episodes=200"`: its `evals/val/` records) has its best step picked on that split's episodes instead
(marked `val` in the table), which the eval's episodes then score without that bias. Below the table: the mean gain
and in how many runs the lower bound is above 0. The RL runs are tagged as one sweep (`dagrl.sweep=recipe-<OUT's
name>[-<arm>]`, swept keys teacher and seed; pipelines.sweep.tag_run): `python -m pipelines.compare --sweep ID
--run-root OUT/runs` gives per teacher the mean over seeds of the final and best eval with Student-t intervals and
the paired differences between teachers (pipelines.sweep_report). Exit: 0 done, 2 bad arguments (one line), 1 a stage failed (its
log named).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from storage.checkpoints import best_checkpoint, latest_checkpoint  # noqa: E402
from storage.rundir import write_text_atomic  # noqa: E402
from storage.tracking import default_tracking_uri  # noqa: E402
from tasks.evalstats import compare_evals, fmt_gain, fmt_rate, pick_baseline, read_evals, wilson_interval  # noqa: E402

FAMILIES = {"pi0": ("pushcube_pi0_sft", "pushcube_pi0_grpo"), "token": ("pushcube_token_sft", "pushcube_token_grpo")}
RECORD_CONF = "pushcube_record"
STAGES = ("record", "sft", "rl")
RUN_LINE = re.compile(r"^dagrl: run (\S+) \| run dir (.+?) \| MLflow ")


class RecipeError(Exception):
    """A bad argument or state (printed as one line `error: ...`, exit 2)."""


class StageFailed(Exception):
    """A CLI exited non-zero or its outputs are missing (exit 1)."""


# ----- the table: pure functions of eval records -----

def _rate(rec: dict, key: str = "success_once") -> tuple[float, float, float, int]:
    eps = rec["episodes"]
    n = len(eps)
    k = sum(bool(e[key]) for e in eps.values())
    lo, hi = wilson_interval(k, n)
    return (k / n if n else float("nan")), lo, hi, n


def _baseline(sft_evals: dict[int, dict], rl_evals: dict[int, dict], sft_step: int | None) -> tuple[str, int] | None:
    """The eval the RL gains pair against, by the runner's rule (tasks.evalstats.pick_baseline, the same as the
    RL run's own `eval/gain_*`): the RL run's step-0 eval (runner.val_at_start), else the SFT run's eval of the
    checkpoint RL started from (`sft_step`) when it was run on the same fixed episodes, else the RL run's first
    eval. ("rl" | "sft", step), or None when there is nothing to pair against."""
    base = pick_baseline(rl_evals, sft_evals.get(sft_step) if sft_step is not None else None)
    if base is None:
        return None
    return ("sft", sft_step) if base[0] == "start" else ("rl", base[1])


def summarize(teacher: str, seed, sft_evals: dict[int, dict], rl_evals: dict[int, dict],
              walls: dict[str, float | None], key: str = "success_once", sft_step: int | None = None,
              val_evals: dict[int, dict] | None = None) -> dict:
    """One table row from a (teacher, seed)'s eval records ({step: record} as `tasks.evalstats.read_evals`).

    `sft_step`: the step of the SFT checkpoint the RL run started from (its `policy.model_path`). `val_evals`: the
    RL run's validation-split records (`read_evals(run, "val")`, env.eval.val_episodes > 0), which then pick the
    best step (`best_on` "val") instead of the eval's own rates (`best_on` "eval", optimistic).
    Returns a JSON-able dict: teacher, seed, sft {step, rate, low, high, n} (its last eval) or None, rl_evals
    [{step, rate, low, high, n}] ascending, best {step, ...} (the eval at the step of the highest rate, the first
    such step, on the validation split when given: then also `val_rate`), best_on, gain_last /
    gain_best {vs, vs_step, step, diff, low, high, n} (paired, Newcombe) vs the baseline (`_baseline`: vs "rl"
    step 0, or vs "sft" step `sft_step`) or None, wall_s {stage: seconds or None}."""
    val = {s: r for s, r in (val_evals or {}).items() if s in rl_evals}
    row: dict = {"teacher": teacher, "seed": seed, "key": key, "sft": None, "rl_evals": [], "best": None,
                 "best_on": "val" if val else "eval", "gain_last": None, "gain_best": None, "wall_s": dict(walls)}
    if sft_evals:
        s = max(sft_evals)
        p, lo, hi, n = _rate(sft_evals[s], key)
        row["sft"] = {"step": s, "rate": p, "low": lo, "high": hi, "n": n}
    for s in sorted(rl_evals):
        p, lo, hi, n = _rate(rl_evals[s], key)
        row["rl_evals"].append({"step": s, "rate": p, "low": lo, "high": hi, "n": n})
    if row["rl_evals"]:
        if val:
            v = {st: _rate(r, key)[0] for st, r in val.items()}
            pick = max(v, key=lambda st: (v[st], -st))
            best = next(e for e in row["rl_evals"] if e["step"] == pick)
            row["best"] = {**best, "val_rate": v[pick]}
        else:
            best = max(row["rl_evals"], key=lambda e: (e["rate"], -e["step"]))
            row["best"] = dict(best)
        base = _baseline(sft_evals, rl_evals, sft_step)
        if base is not None:
            vs, vs_step = base
            before = (rl_evals if vs == "rl" else sft_evals)[vs_step]["episodes"]

            def gain(step: int) -> dict:
                c = compare_evals(rl_evals[step]["episodes"], before, key)
                return {"vs": vs, "vs_step": vs_step, "step": step, "diff": c.diff, "low": c.low, "high": c.high,
                        "n": c.n}

            last = max(rl_evals)
            if not (vs == "rl" and last == vs_step):
                row["gain_last"] = gain(last)
                row["gain_best"] = gain(best["step"])
    return row


def _cell_rate(e: dict | None) -> str:
    return "—" if e is None else fmt_rate(e["rate"], e["low"], e["high"])


def _cell_gain(g: dict | None) -> str:
    return "—" if g is None else fmt_gain(g["diff"], g["low"], g["high"])


def _cell_wall(s) -> str:
    return "—" if s is None else f"{s:.0f}"


def table_markdown(rows: list[dict]) -> str:
    """The one table (markdown) of `summarize` rows, and two summary lines under it."""
    steps = sorted({e["step"] for r in rows for e in r["rl_evals"]})
    n_eps = sorted({e["n"] for r in rows for e in r["rl_evals"]} | {r["sft"]["n"] for r in rows if r["sft"]})
    key = rows[0]["key"] if rows else "success_once"
    head = (["teacher", "seed", "SFT"] + [f"RL step {s}" for s in steps]
            + ["best (step)", "gain last", "gain best", "wall record / SFT / RL (s)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        by_step = {e["step"]: e for e in r["rl_evals"]}
        best = "—" if r["best"] is None else \
            f"{_cell_rate(r['best'])} ({r['best']['step']}{', val' if r.get('best_on') == 'val' else ''})"
        w = r["wall_s"]
        cells = ([str(r["teacher"]), str(r["seed"]), _cell_rate(r["sft"])] + [_cell_rate(by_step.get(s)) for s in steps]
                 + [best, _cell_gain(r["gain_last"]), _cell_gain(r["gain_best"]),
                    " / ".join(_cell_wall(w.get(k)) for k in STAGES)])
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    on_val = [r.get("best_on") == "val" for r in rows if r["best"] is not None]
    picked = ("the best step is picked on a validation split of other episodes (env.eval.val_episodes) and "
              "scored on the eval's, as is the last" if on_val and all(on_val) else
              "the best eval is picked on the episodes it is scored on (optimistic), the last is not"
              + ("; rows marked 'val' pick it on a validation split" if any(on_val) else ""))
    lines.append(f"{key} on {', '.join(map(str, n_eps)) or '?'} fixed eval episodes; [Wilson 95 %]; gains vs the RL "
                 f"run's step-0 eval, or (without one) the SFT run's eval of the checkpoint RL started from, with "
                 f"[Newcombe paired 95 %]; {picked}.")
    for which in ("gain_last", "gain_best"):
        gs = [r[which] for r in rows if r[which] is not None]
        if gs:
            mean = sum(g["diff"] for g in gs) / len(gs)
            pos = sum(g["low"] > 0 for g in gs)
            neg = sum(g["high"] < 0 for g in gs)
            lines.append(f"{which.replace('_', ' ')}: mean {mean:+.3f} over {len(gs)} runs; lower bound > 0 in "
                         f"{pos}/{len(gs)}, upper bound < 0 in {neg}/{len(gs)}")
    return "\n".join(lines) + "\n"


def write_table(rows: list[dict], out: Path, meta: dict | None = None, stem: str = "recipe") -> str:
    """Write OUT/<stem>.md and OUT/<stem>.json (rows + meta); returns the markdown."""
    md = table_markdown(rows)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / f"{stem}.md", md)
    write_text_atomic(out / f"{stem}.json", json.dumps({"meta": meta or {}, "rows": rows}, indent=1))
    return md


# ----- running the stages -----

def _launch(cmd: list[str], log: Path, on_line: Callable[[str], None]) -> int:
    """Run `cmd` from the repo root, its stdout+stderr to `log` (and each line to `on_line`); returns the exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             bufsize=1)
        try:
            for line in p.stdout:
                f.write(line)
                f.flush()  # the log is what a user tails to follow a stage
                on_line(line.rstrip("\n"))
            return p.wait()
        except BaseException:
            p.terminate()
            p.wait()
            raise


@dataclass
class Recipe:
    """record -> SFT -> RL for teachers x seeds under `out` (module docstring). `launch(cmd, log, on_line) -> rc`
    runs one CLI (tests pass a fake)."""

    teachers: list[str]
    seeds: list[int]
    out: Path
    sft_conf: str
    rl_conf: str
    record_args: list[str] = field(default_factory=list)
    sft_args: list[str] = field(default_factory=list)
    rl_args: list[str] = field(default_factory=list)
    sft_checkpoint: str = "latest"
    redo: str | None = None
    stop_after: str | None = None  # "record" | "sft": run the stages up to this one only
    rl_arm: str | None = None  # an RL variant's name: its markers rl_<arm>.json, its table recipe_<arm>.md
    dry_run: bool = False
    python: str = sys.executable
    launch: Callable = _launch
    echo: Callable = print

    def __post_init__(self):
        self.out = Path(self.out).resolve()
        self.runs = self.out / "runs"
        self.uri = default_tracking_uri(self.runs)
        names = [Path(t).name or t for t in self.teachers]
        self.names = [n if names.count(n) == 1 else f"t{i}_{n}" for i, n in enumerate(names)]

    def _common(self) -> list[str]:
        return [f"run_root={self.runs}", f"tracking.uri={self.uri}"]

    def _marker(self, name: str, seed, stage: str) -> Path:
        d = self.out / name if seed is None else self.out / name / f"seed{seed}"
        return d / (f"rl_{self.rl_arm}.json" if stage == "rl" and self.rl_arm else f"{stage}.json")

    @property
    def table_stem(self) -> str:
        """The table's file name without suffix: `recipe`, or `recipe_<arm>` for an RL arm."""
        return f"recipe_{self.rl_arm}" if self.rl_arm else "recipe"

    def _redo(self, stage: str) -> bool:
        return self.redo is not None and STAGES.index(stage) >= STAGES.index(self.redo)

    def _done(self, marker: Path, cmd: list[str], stage: str) -> dict | None:
        """The marker's record when the stage is complete with this command; raises RecipeError on another one."""
        if not marker.is_file():
            return None
        if self._redo(stage):
            marker.unlink()
            return None
        rec = json.loads(marker.read_text())
        if rec.get("cmd") != cmd:
            raise RecipeError(f"{marker}: stage {stage} was completed with another command ({shlex.join(rec.get('cmd', []))}); "
                              f"use another --out, or --redo {stage}")
        return rec

    def _run_cli(self, stage: str, name: str, seed, cmd: list[str]) -> tuple[dict, float]:
        """Run a pipelines.run stage (resuming a started one); returns ({run_id, run_dir}, wall seconds)."""
        marker = self._marker(name, seed, stage)
        started = marker.with_name(f"{marker.stem}.started.json")
        full = list(cmd)
        if started.is_file() and not self._redo(stage):
            s = json.loads(started.read_text())
            if s.get("cmd") == cmd and latest_checkpoint(s["run_dir"]) is not None:
                full.append(f"runner.resume={s['run_id']}")
                self.echo(f"recipe: {stage} {name} seed {seed}: resuming run {s['run_id']}")
        seen: dict = {}

        def on_line(line: str) -> None:
            m = RUN_LINE.match(line)
            if m and not seen:
                seen.update(run_id=m.group(1), run_dir=m.group(2))
                started.parent.mkdir(parents=True, exist_ok=True)
                write_text_atomic(started, json.dumps({"cmd": cmd, **seen}))

        log = self.out / "logs" / f"{name}_seed{seed}_{marker.stem}.log"
        self.echo(f"recipe: {stage} {name} seed {seed}: {shlex.join(full)}  (log {log})")
        t0 = time.perf_counter()
        rc = self.launch(full, log, on_line)
        wall = time.perf_counter() - t0
        if rc != 0:
            raise StageFailed(f"{stage} of teacher {name} seed {seed} exited {rc}; see {log}")
        if not seen:
            raise StageFailed(f"{stage} of teacher {name} seed {seed}: no 'dagrl: run ... | run dir ...' line in {log}")
        return seen, wall

    def record(self, i: int) -> dict:
        name, teacher = self.names[i], self.teachers[i]
        store = self.out / name / "demos.zarr"
        cmd = [self.python, "-m", "pipelines.record", f"conf={RECORD_CONF}", f"record.teacher={teacher}",
               f"record.out={store}", f"run_root={self.runs}", *self.record_args]  # record refuses tracking.uri (it logs nothing to MLflow)
        marker = self._marker(name, None, "record")
        rec = self._done(marker, cmd, "record")
        if rec is not None:
            return rec
        if self.dry_run:
            self.echo(shlex.join(cmd))
            return {"store": str(store), "wall_s": None, "dry_run": True}
        if store.exists():  # an interrupted recording (no marker): the recorder refuses an existing store
            self.echo(f"recipe: removing the incomplete store {store}")
            shutil.rmtree(store)
        log = self.out / "logs" / f"{name}_record.log"
        self.echo(f"recipe: record {name}: {shlex.join(cmd)}  (log {log})")
        t0 = time.perf_counter()
        rc = self.launch(cmd, log, lambda line: None)
        wall = time.perf_counter() - t0
        if rc != 0 or not store.exists():
            raise StageFailed(f"record of teacher {name} exited {rc}" + ("" if store.exists() else
                                                                         f" without writing {store}") + f"; see {log}")
        rec = {"cmd": cmd, "store": str(store), "wall_s": wall}
        marker.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(marker, json.dumps(rec))
        return rec

    def _run_stage(self, stage: str, i: int, seed: int, cmd: list[str]) -> dict:
        name = self.names[i]
        marker = self._marker(name, seed, stage)
        rec = self._done(marker, cmd, stage)
        if rec is not None:
            return rec
        if self.dry_run:
            self.echo(shlex.join(cmd))
            return {"run_dir": None, "wall_s": None, "dry_run": True}
        seen, wall = self._run_cli(stage, name, seed, cmd)
        run_dir = Path(seen["run_dir"])
        if not read_evals(run_dir) or latest_checkpoint(run_dir) is None:
            raise StageFailed(f"{stage} of teacher {name} seed {seed}: {run_dir} has no eval records or no checkpoint")
        rec = {"cmd": cmd, "run_id": seen["run_id"], "run_dir": str(run_dir), "wall_s": wall}
        write_text_atomic(marker, json.dumps(rec))
        if stage == "rl":  # the RL runs as one sweep: `pipelines.compare --sweep <sweep_id> --run-root OUT/runs`
            from pipelines.sweep import tag_run
            tag_run(self.uri, seen["run_id"], self.sweep_id, {"teacher": name, "seed": str(seed)})
        return rec

    @property
    def sweep_id(self) -> str:
        """The sweep id the RL stage's MLflow runs are tagged with (`dagrl.sweep`, swept keys teacher and seed):
        `recipe-<OUT's name>[-<arm>]`; their report (mean over seeds per teacher with Student-t intervals, paired
        differences between teachers): `python -m pipelines.compare --sweep ID --run-root OUT/runs`."""
        return f"recipe-{self.out.name}" + (f"-{self.rl_arm}" if self.rl_arm else "")

    def sft_hf(self, sft_run: Path) -> Path:
        ckpt = best_checkpoint(sft_run) if self.sft_checkpoint == "best" else latest_checkpoint(sft_run)
        if ckpt is None:
            raise StageFailed(f"SFT run {sft_run} has no {self.sft_checkpoint} checkpoint")
        return ckpt / "hf"

    def run(self) -> list[dict]:
        """Every stage that is not complete, then the table's rows."""
        rows = []
        for i, name in enumerate(self.names):
            rec = self.record(i)
            if self.stop_after == "record":
                continue
            for seed in self.seeds:
                sft_cmd = [self.python, "-m", "pipelines.run", f"conf={self.sft_conf}", f"sft.store={rec['store']}",
                           f"seed={seed}", *self._common(), *self.sft_args]
                sft = self._run_stage("sft", i, seed, sft_cmd)
                if self.stop_after == "sft":
                    continue
                hf = self.sft_hf(Path(sft["run_dir"])) if sft.get("run_dir") else "<SFT run>/checkpoints/global_step_N/hf"
                rl_cmd = [self.python, "-m", "pipelines.run", f"conf={self.rl_conf}", f"policy.model_path={hf}",
                          f"seed={seed}", *self._common(), *self.rl_args]
                rl = self._run_stage("rl", i, seed, rl_cmd)
                if self.dry_run:
                    continue
                rows.append(summarize(name, seed, read_evals(sft["run_dir"]), read_evals(rl["run_dir"]),
                                      {"record": rec.get("wall_s"), "sft": stage_wall(sft), "rl": stage_wall(rl)},
                                      sft_step=model_step(rl_cmd), val_evals=read_evals(rl["run_dir"], "val")))
        return rows

    def rows_from_markers(self) -> list[dict]:
        """The rows of every (teacher, seed) whose RL stage is complete (`--table-only`)."""
        rows = []
        for i, name in enumerate(self.names):
            rmark = self._marker(name, None, "record")
            rec = json.loads(rmark.read_text()) if rmark.is_file() else {}
            for seed in self.seeds:
                sm, lm = self._marker(name, seed, "sft"), self._marker(name, seed, "rl")
                if not (sm.is_file() and lm.is_file()):
                    continue
                sft, rl = json.loads(sm.read_text()), json.loads(lm.read_text())
                rows.append(summarize(name, seed, read_evals(sft["run_dir"]), read_evals(rl["run_dir"]),
                                      {"record": rec.get("wall_s"), "sft": stage_wall(sft), "rl": stage_wall(rl)},
                                      sft_step=model_step(rl.get("cmd", [])),
                                      val_evals=read_evals(rl["run_dir"], "val")))
        return rows


def stage_wall(rec: dict) -> float | None:
    """A finished run stage's wall time (s): the runner's elapsed training time in its latest checkpoint's
    meta.json (`run.runner.elapsed_s`, summed over resumes, start-up excluded), else the marker's `wall_s` (the
    last invocation's: it misses the earlier ones of a resumed stage)."""
    try:
        ckpt = latest_checkpoint(rec["run_dir"])
        return float(json.loads((Path(ckpt) / "meta.json").read_text())["run"]["runner"]["elapsed_s"])
    except (TypeError, OSError, ValueError, KeyError):
        return rec.get("wall_s")


def model_step(cmd: list[str]) -> int | None:
    """N of the `policy.model_path=.../global_step_N/hf` in an RL command (the SFT checkpoint it started from)."""
    for arg in cmd:
        m = re.match(r"^policy\.model_path=.*global_step_(\d+)/hf/?$", arg)
        if m:
            return int(m.group(1))
    return None


def _conf_exists(name: str) -> bool:
    return (ROOT / "conf" / "conf" / f"{name}.yaml").is_file()


def _resolve_teacher(t: str) -> Path:
    """A teacher run dir (absolute: the stages run with another run_root), given as a dir or a run id under
    <repo>/runs. Raises RecipeError."""
    p = Path(t)
    if p.is_dir():
        return p.resolve()
    from storage.rundir import find_run_dir
    try:
        return find_run_dir(ROOT / "runs", t).resolve()
    except (FileNotFoundError, ValueError) as exc:
        raise RecipeError(f"--teachers {t}: not a run directory nor a run id under {ROOT / 'runs'} ({exc})") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--teachers", nargs="+", required=True, help="teacher PPO run dirs (or run ids)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1])
    ap.add_argument("--out", type=Path, required=True, help="output folder (run_root, MLflow, markers, table)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="pi0")
    ap.add_argument("--sft-conf", default=None)
    ap.add_argument("--rl-conf", default=None)
    ap.add_argument("--record", default="", help='extra overrides of the record stage, "k=v k=v"')
    ap.add_argument("--sft", default="", help='extra overrides of the SFT stage, "k=v k=v"')
    ap.add_argument("--rl", default="", help='extra overrides of the RL stage, "k=v k=v"')
    ap.add_argument("--sft-checkpoint", choices=("latest", "best"), default="latest")
    ap.add_argument("--redo", choices=STAGES, default=None, help="run this stage and the later ones again")
    ap.add_argument("--stop-after", choices=STAGES[:-1], default=None,
                    help="run the stages up to this one only (a later call with the same --out goes on)")
    ap.add_argument("--rl-arm", default=None, metavar="NAME",
                    help="name this RL variant: markers rl_NAME.json, table recipe_NAME.md (record and SFT shared)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands of the stages left; run nothing")
    ap.add_argument("--table-only", action="store_true", help="only the table of the complete (teacher, seed)s")
    return ap.parse_args(argv)


def make_recipe(a: argparse.Namespace, **kw) -> Recipe:
    """A Recipe from parsed arguments. Raises RecipeError (a conf that does not exist, a bad override string)."""
    sft_conf = a.sft_conf or FAMILIES[a.family][0]
    rl_conf = a.rl_conf or FAMILIES[a.family][1]
    for flag, conf in (("--sft-conf", sft_conf), ("--rl-conf", rl_conf)):
        if not _conf_exists(conf):
            raise RecipeError(f"{flag}={conf}: no conf/conf/{conf}.yaml (family {a.family}); name an existing conf")
    lists = {}
    for flag in ("record", "sft", "rl"):
        try:
            items = shlex.split(getattr(a, flag))
        except ValueError as exc:
            raise RecipeError(f"--{flag}={getattr(a, flag)!r}: {exc}") from None
        bad = [x for x in items if "=" not in x]
        if bad:
            raise RecipeError(f"--{flag}={getattr(a, flag)!r}: {bad[0]!r} is not a k=v override")
        lists[flag] = items
    teachers = [str(_resolve_teacher(t)) for t in a.teachers]
    if len(set(a.seeds)) != len(a.seeds):
        raise RecipeError(f"--seeds {' '.join(map(str, a.seeds))}: a seed is repeated")
    if a.rl_arm is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", a.rl_arm):
        raise RecipeError(f"--rl-arm {a.rl_arm!r}: use letters, digits, '_', '.' or '-' (it names files)")
    return Recipe(teachers=teachers, seeds=list(a.seeds), out=a.out, sft_conf=sft_conf, rl_conf=rl_conf,
                  record_args=lists["record"], sft_args=lists["sft"], rl_args=lists["rl"],
                  sft_checkpoint=a.sft_checkpoint, redo=a.redo, stop_after=a.stop_after, rl_arm=a.rl_arm,
                  dry_run=a.dry_run, **kw)


def main(argv: list[str] | None = None, **kw) -> int:
    a = parse_args(argv)
    try:
        r = make_recipe(a, **kw)
        rows = r.rows_from_markers() if a.table_only else r.run()
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StageFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if a.dry_run:
        return 0
    meta = {"teachers": r.teachers, "names": r.names, "seeds": r.seeds, "sft_conf": r.sft_conf, "rl_conf": r.rl_conf,
            "record": r.record_args, "sft": r.sft_args, "rl": r.rl_args, "sft_checkpoint": r.sft_checkpoint,
            "rl_arm": r.rl_arm,
            "written_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(write_table(rows, r.out, meta, r.table_stem), end="")
    print(f"recipe: table -> {r.out / (r.table_stem + '.md')}, {r.out / (r.table_stem + '.json')}")
    if a.stop_after is None:
        print(f"recipe: the RL runs as a sweep: python -m pipelines.compare --sweep {r.sweep_id} --run-root {r.runs}")
    return 0


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))  # Ctrl-C: one line `interrupted`, exit 130
