"""Post-hoc averaged weights of an RL run, evaluated on the run's fixed episodes (the measurement behind
`algorithm.ema_decay`).

    .venv/bin/python benchmarks/weight_average.py RUN_DIR --decays 0.8 0.9 --steps 12 18 24 \
        [--eval "env.robot_visual_lod=0.1"] [--out DIR]

RUN_DIR must hold a checkpoint at every step 1..max(--steps) (`runner.save_interval=1`,
`runner.keep_checkpoints` >= that many); the start weights (step 0) are the run's `policy.model_path` export (an
RL run from an SFT checkpoint). For each decay d, the exponential moving average of the trained weights
(`tasks.actor.actor.ema_update_`: ema_0 = the start weights, ema_k = d ema_{k-1} + (1 - d) w_k: what a run with
`algorithm.ema_decay=d` keeps) is written at each of --steps as an hf dir (the checkpoint's export with the average
as model.safetensors) and evaluated with `python -m pipelines.eval HF_DIR conf=<the run's experiment> <--eval>`
(pass the run's env overrides the eval depends on, e.g. env.robot_visual_lod). Printed per step: the run's own eval
(of the trained weights; of its own average when it ran with algorithm.ema_decay > 0) and each average's, with the
paired difference (Newcombe 95 %) and each one's gain over the start checkpoint's eval (its SFT run's record, when
it has one on the same episodes). `--decays 0` evaluates the trained weights themselves.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def average_states(start: dict, states: dict[int, dict], decay: float, steps: list[int]) -> dict[int, dict]:
    """{step: the average at that step} for the trained weights `states` (step -> state dict, every step
    1..max(steps)) from `start` (step 0), by `tasks.actor.actor.ema_update_`.

    Raises KeyError naming a missing step."""
    from tasks.actor.actor import ema_update_
    ema = {k: v.detach().clone().float() if v.is_floating_point() else v.clone() for k, v in start.items()}
    out = {}
    for s in range(1, max(steps) + 1):
        if s not in states:
            raise KeyError(f"no checkpoint of step {s}: the run must keep every step up to {max(steps)} "
                           f"(runner.save_interval=1, runner.keep_checkpoints >= {max(steps)})")
        ema_update_(ema, states[s], decay)
        if s in steps:
            out[s] = {k: v.clone() for k, v in ema.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--decays", type=float, nargs="+", required=True)
    ap.add_argument("--steps", type=int, nargs="+", required=True)
    ap.add_argument("--eval", default="", help='extra pipelines.eval overrides, "k=v k=v"')
    ap.add_argument("--out", type=Path, help="output folder (default RUN_DIR/weight_average)")
    args = ap.parse_args(argv)
    from omegaconf import OmegaConf
    from safetensors.torch import load_file, save_file

    from storage.checkpoints import load_checkpoint
    from storage.exports import index_export
    from tasks.evalstats import compare_evals, read_evals, start_checkpoint_eval
    run, out = args.run_dir.resolve(), (args.out or args.run_dir / "weight_average").resolve()
    from pipelines.config import read_saved_config
    cfg = read_saved_config(run / "config.yaml")  # verified (a cut file would read as defaults)
    model_path = Path(cfg.policy.model_path)
    sft = load_file(str(model_path / "model.safetensors"))
    states = {}
    for s in range(1, max(args.steps) + 1):
        ck = run / "checkpoints" / f"global_step_{s}"
        if ck.is_dir():
            states[s] = load_checkpoint(ck, keys=("policy",))["policy"]
    if 1 not in states:
        raise SystemExit(f"error: {run} has no checkpoint of step 1 (runner.save_interval=1)")
    # the run's step-0 weights: what tasks.policies.load_pretrained made of model_path; a head it kept fresh (a
    # value head of another shape, a Flow-Noise std head the run does not have) is taken from step 1, exact when
    # the update never trains it (GRPO's value head)
    fresh = sorted(k for k, v in states[1].items() if k not in sft or sft[k].shape != v.shape)
    start = {k: (states[1][k] if k in fresh else sft[k]) for k in states[1]}
    if fresh:
        print(f"start weights: {len(fresh)} tensors not in {model_path} with the run's shapes, taken from step 1: "
              f"{sorted({k.split('.')[0] for k in fresh})}")
    own = read_evals(run)
    base = start_checkpoint_eval(str(model_path))
    base_eps = base[1]["episodes"] if base else None
    rows = []
    for d in args.decays:
        for s, sd in average_states(start, states, d, args.steps).items():
            hf = out / f"ema{d}_step{s}" / "hf"
            eval_out = out / f"ema{d}_step{s}" / "eval"
            if not (eval_out / "eval.json").is_file():
                shutil.rmtree(hf.parent, ignore_errors=True)
                shutil.copytree(run / "checkpoints" / f"global_step_{s}" / "hf", hf)
                (hf / "dagrl_files.json").unlink()
                save_file({k: v.contiguous() for k, v in sd.items()}, str(hf / "model.safetensors"),
                          metadata={"format": "pt"})
                index_export(hf)
                cmd = [sys.executable, "-m", "pipelines.eval", str(hf), f"conf={cfg.experiment}",
                       f"env.eval.num_episodes={cfg.env.eval.num_episodes}", f"run_root={out / 'runs'}",
                       "runner.progress=false", "runner.eval_videos=0", *args.eval.split(), "--out", str(eval_out)]
                subprocess.run(cmd, cwd=ROOT, check=True)
            rows.append((d, s, json.loads((eval_out / "eval.json").read_text())["episodes"]))
    own_ema = OmegaConf.select(cfg, "algorithm.ema_decay", default=0.0) or 0.0
    label = f"run's eval (its average, decay {own_ema})" if own_ema else "run's eval (trained weights)"
    print(f"run {run.name}: averaged weights (ema decay d) against the {label}, success_once on its fixed episodes")
    for d, s, eps in rows:
        line = f"step {s:3d} d={d}: average {sum(e['success_once'] for e in eps.values()) / len(eps):.3f}"
        if s in own:
            c = compare_evals(eps, own[s]["episodes"])
            line += f" | run's eval {c.before:.3f} | difference {c.diff:+.3f} [{c.low:+.2f}, {c.high:+.2f}]"
        if base_eps is not None:
            g = compare_evals(eps, base_eps)
            line += f" | gain over start {g.diff:+.3f} [{g.low:+.2f}, {g.high:+.2f}]"
            if s in own:
                t = compare_evals(own[s]["episodes"], base_eps)
                line += f" (run's eval: {t.diff:+.3f} [{t.low:+.2f}, {t.high:+.2f}])"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
