"""The eval records of `python -m pipelines.upgrade`: `<run_dir>/evals/step_<N>.json` (and `evals/val/`) written
before 2026-12-04 lack `eval_layout` (tasks.evalstats.eval_layout: eval envs, shards, policy device), which decides
whether two evals of the same weights on the same episodes are the same eval. The run's config gives it: the
layout its evals ran in, what the runner writes into every record today (a resume that changed env.eval.num_envs,
env.num_shards or policy.device before 2026-12-04 is not told apart: the saved config holds the last values).
"""
from __future__ import annotations

import json
from pathlib import Path

SPLITS = ("eval", "val")


def plan_evals(run_dir: Path) -> list[Path]:
    """The eval record files of `run_dir` (both splits) without `eval_layout`, by step."""
    from tasks.evalstats import _eval_files
    out = []
    for split in SPLITS:
        for f in _eval_files(run_dir, split).values():
            try:
                rec = json.loads(f.read_text())
            except (OSError, ValueError):
                continue  # damaged: today's reader names it; not the upgrade's to mend
            if isinstance(rec, dict) and "eval_layout" not in rec:
                out.append(f)
    return out


def upgraded_record(rec: dict, layout: dict) -> dict:
    """The record `tasks.evalstats.write_eval` writes today for the same eval: {"step", the extras with
    `eval_layout` after them, "summary", "episodes"}."""
    extra = {k: v for k, v in rec.items() if k not in ("step", "summary", "episodes")}
    return {"step": rec["step"], **extra, "eval_layout": layout, "summary": rec["summary"],
            "episodes": rec["episodes"]}


def stage_evals(run_dir: Path, stage: Path, files: list[Path], cfg) -> list[Path]:
    """Write today's version of each of `files` (records of `run_dir`) under `stage` at the same relative path, with
    the layout of `cfg` (the run's Config); each read back. Returns the staged paths (in `files`' order)."""
    from tasks.evalstats import eval_layout
    layout, out = eval_layout(cfg), []
    for f in files:
        new = stage / f.relative_to(run_dir)
        new.parent.mkdir(parents=True, exist_ok=True)
        rec = upgraded_record(json.loads(f.read_text()), layout)
        new.write_text(json.dumps(rec, indent=0, sort_keys=False))
        if json.loads(new.read_text()) != rec:
            raise OSError(f"{new}: the record read back differs from the one written")
        out.append(new)
    return out
