"""Export a recording as a LeRobot dataset: `python -m pipelines.export STORE --format lerobot --out DIR`.

STORE is a trajectory store `python -m pipelines.record` wrote (its episodes, one per env per round). DIR (which
must not exist) receives a LeRobot v3.0 dataset (meta/info.json, meta/stats.json, meta/tasks.parquet,
meta/episodes/, data/, videos/): one frame per executed action, `action` the stored action, `observation.state`
and the camera videos (`observation.images.rgb`, `observation.images.wrist_rgb` with LIBERO's env.wrist_camera) the
observation at the start of the action's chunk (a recording stores one per chunk of policy.num_action_chunks
actions: record with policy.num_action_chunks=1 for a new one on every frame), the task the episode's instruction,
and next.reward / next.done / next.success. meta/dagrl.json names the env and the chunk length, which `sft.store`
checks when it reads the dataset back (`sft.store=DIR`: any LeRobot v3.0 dataset directory; tasks/demo_datasets.py).
Videos are H.264 (yuv420p): decoded images differ from the stored ones by the codec's error.

Exit codes: 0 written, 2 bad words, a STORE that is not a finished recording, DIR exists, 1 failure.

Examples:
  python -m pipelines.export runs/demos/pushcube_record.zarr --format lerobot --out runs/datasets/pushcube_demos
  python -m pipelines.run conf=pushcube_pi0_sft sft.store=runs/datasets/pushcube_demos sft.value_coef=0
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = ("lerobot",)
DEFAULT_FPS = 20.0  # ManiSkill's PushCube / PickCube and LIBERO control at 20 Hz


def _parser() -> argparse.ArgumentParser:
    from pipelines.cli import ArgumentParser, examples, version
    p = ArgumentParser(prog="python -m pipelines.export", epilog=examples(__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Write a pipelines.record store's episodes as a LeRobot v3.0 dataset.")
    p.add_argument("store", metavar="STORE", type=Path, help="a trajectory store pipelines.record wrote")
    p.add_argument("--format", choices=FORMATS, default="lerobot", help="the dataset format (default: lerobot)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the dataset directory (must not exist)")
    p.add_argument("--fps", type=float, default=DEFAULT_FPS,
                   help=f"frames per second of the dataset: the env's control frequency (default {DEFAULT_FPS:g})")
    p.add_argument("--version", action="version", version=version())
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.export ...` (module docstring). Returns the exit code."""
    from pipelines.cli import parse_words, quiet
    args = parse_words(_parser(), argv)
    if isinstance(args, int):
        return args
    quiet()
    from tasks.demo_datasets import export_store
    if not (args.fps > 0):
        print(f"error: --fps {args.fps:g}: use a positive frame rate (the env's control frequency)", file=sys.stderr)
        return 2
    if args.out.exists():
        print(f"error: --out {args.out} exists; choose a new directory (a dataset is never overwritten)",
              file=sys.stderr)
        return 2
    if not (args.store / "zarr.json").is_file():
        print(f"error: {args.store} is not a trajectory store (no zarr.json); give the store pipelines.record wrote",
              file=sys.stderr)
        return 2
    try:
        s = export_store(args.store, args.out, fps=args.fps)
    except (ValueError, FileExistsError) as exc:  # a damaged or old store (DamagedStore, OldStore) included
        print(f"error: {exc}", file=sys.stderr)
        return 2
    held = (f"; state and images held over each chunk of {s['observation_every']} actions"
            if s["observation_every"] > 1 else "")
    print(f"dagrl export: {s['episodes']} episodes, {s['frames']} frames at {args.fps:g} fps{held} -> {s['out']}")
    return 0


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
