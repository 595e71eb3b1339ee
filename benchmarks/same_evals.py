"""Do two runs play the same evaluations? Compares the per-episode eval records (`<run dir>/evals/step_N.json`) of
two run directories step by step and prints one markdown table: each step's success_once in both runs and whether
every episode record is identical (timing fields aside). Used to show that a restructure kept behaviour: the same
config on the same machine must give the same episodes at every evaluation.

    python benchmarks/same_evals.py RUN_DIR_A RUN_DIR_B [--labels before after]

Exit code 0 when every step both runs evaluated is identical and both evaluated the same steps, else 1.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TIMING = ("time", "wall", "second", "duration")


def records(run_dir: Path) -> dict[int, dict]:
    """step -> the eval record of `run_dir` (its evals/step_N.json files)."""
    out = {}
    for f in (run_dir / "evals").glob("step_*.json"):
        out[int(re.fullmatch(r"step_(\d+)\.json", f.name).group(1))] = json.loads(f.read_text())
    return out


def _untimed(episode: dict) -> dict:
    return {k: v for k, v in episode.items() if not any(t in k.lower() for t in TIMING)}


def same_episodes(a: dict, b: dict) -> bool:
    """Every episode record of eval record `a` equals `b`'s, timing fields aside."""
    ea, eb = a["episodes"], b["episodes"]
    if isinstance(ea, dict):
        ea, eb = [ea[k] for k in sorted(ea)], [eb.get(k) for k in sorted(ea)] if set(ea) == set(eb) else None
    return eb is not None and len(ea) == len(eb) and all(_untimed(x) == _untimed(y) for x, y in zip(ea, eb))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--labels", nargs=2, default=["A", "B"])
    args = ap.parse_args(argv)
    A, B = records(args.run_a), records(args.run_b)
    ok = set(A) == set(B) and bool(A)
    print(f"| step | {args.labels[0]} success_once | {args.labels[1]} success_once | every episode identical |")
    print("|---|---|---|---|")
    for s in sorted(set(A) | set(B)):
        a, b = A.get(s), B.get(s)
        same = same_episodes(a, b) if a and b else None
        ok = ok and bool(same)
        print(f"| {s} | {a['summary']['success_once'] if a else '-'} | {b['summary']['success_once'] if b else '-'} | "
              f"{'yes' if same else 'no' if same is False else 'only one run'} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
