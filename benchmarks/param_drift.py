"""How far an RL run moved the policy's parameters from its start: mean and median |theta_k - theta_0| per element.

    .venv/bin/python benchmarks/param_drift.py START CHECKPOINT [CHECKPOINT ...]

START is the run's start weights: an hf dir (`model.safetensors`, e.g. the SFT checkpoint's `hf/` that the RL run
took as `policy.model_path`) or a checkpoint dir (its trained weights, `policy`). Each CHECKPOINT is a
`checkpoints/global_step_N` dir of the run; for it the script prints one line for its trained weights (`policy`)
and one for the moving average (`policy_ema`, when the run kept one: `algorithm.ema_decay` > 0):

    global_step_24 policy: 83399 of 183283 compared elements changed, mean |dtheta| 1.39e-03, median 1.11e-03 (0 ...)

Only floating-point tensors present in both, with equal shapes, are compared (a frozen prefix counts as compared
and unchanged; tensors named or shaped differently are counted as skipped). Used for LIBERO's GRPO (README
"LIBERO"): the same per-element movement as a PushCube run that gained, with opposite outcomes.

A START or CHECKPOINT that is not a directory ends with one line naming it (exit 2); a damaged checkpoint raises
`storage.checkpoints.load_checkpoint`'s error.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_start(path: Path) -> dict[str, torch.Tensor]:
    """The state dict at `path`: an hf dir's model.safetensors, or a checkpoint dir's `policy`."""
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file
        return load_file(str(path / "model.safetensors"))
    from storage.checkpoints import load_checkpoint
    return load_checkpoint(path, keys=("policy",))["policy"]


def drift(start: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> dict[str, float | int]:
    """Per-element |state - start| over the floating-point tensors both hold with equal shapes.

    Returns {"compared": elements compared, "changed": elements with a nonzero difference, "mean": mean |d| over
    the changed elements, "median": their median, "skipped": tensors of `state` not compared}; mean and median
    are 0.0 when nothing changed."""
    diffs, compared, skipped = [], 0, 0
    for name, value in state.items():
        ref = start.get(name)
        if ref is None or not value.is_floating_point() or ref.shape != value.shape:
            skipped += 1
            continue
        d = (value.double() - ref.double()).abs().flatten()
        compared += d.numel()
        diffs.append(d[d > 0])
    changed = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    return {"compared": compared, "changed": int(changed.numel()), "skipped": skipped,
            "mean": float(changed.mean()) if changed.numel() else 0.0,
            "median": float(changed.median()) if changed.numel() else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("start", type=Path, help="the run's start weights: an hf dir or a checkpoint dir")
    ap.add_argument("checkpoints", type=Path, nargs="+", help="checkpoints/global_step_N dirs of the run")
    args = ap.parse_args(argv)
    from storage.checkpoints import load_checkpoint, played_policy_key
    for p in [args.start, *args.checkpoints]:
        if not p.is_dir():
            print(f"error: {p}: no such directory (an hf dir or a checkpoints/global_step_N dir)", file=sys.stderr)
            return 2
    start = load_start(args.start)
    for ck in args.checkpoints:
        keys = ("policy", "policy_ema") if played_policy_key(ck) == "policy_ema" else ("policy",)
        weights = load_checkpoint(ck, keys=keys)  # the weights only, not the optimizer state
        for key in keys:
            d = drift(start, weights[key])
            print(f"{ck.name} {key}: {d['changed']} of {d['compared']} compared elements changed, mean |dtheta| "
                  f"{d['mean']:.2e}, median {d['median']:.2e} ({d['skipped']} tensors skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
