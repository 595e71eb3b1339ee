"""Execution-schedule benchmark: colocated vs disaggregated inference, pipeline stages, asynchronous steps.

    .venv/bin/python benchmarks/schedules.py [--steps 5] [--warmup 1] [--num-envs 16] [--chunk-steps 50]
                                               [--num-shards 2] [--env-workers 2] [--hidden 1024]
                                               [--only NAME ...] [--set KEY=VALUE ...]

One embedded Dask cluster (the default: 2 env workers `CPU=1`, 1 logical GPU worker `GPU=1`, one thread each) runs,
one after the other, the same training config under six execution settings:

    colocated           rollout.inference=colocated (one env_step node per shard per step, inference inside)
    colocated k=1       + runner.max_staleness=1 (step n+1's rollout on v(n) overlaps update n)
    disagg p=1          rollout.inference=disaggregated (policy_infer node per chunk step on the GPU worker)
    disagg p=2          + rollout.pipeline_stage_num=2 (two stage groups per shard, interleaved chains)
    disagg p=1 k=1      disaggregated + max_staleness=1
    disagg p=2 k=1      disaggregated + p=2 + max_staleness=1

Config (all settings): conf/config.yaml's default experiment (PushCube-v1, state obs, pd_joint_delta_pos) with
`env.num_envs` (16) in 2 shards, T = `rollout.chunk_steps` (50) chunk steps of 1 action, an MLP policy of
3 x 1024 hidden units (`policy.hidden_sizes=[1024,1024,1024]`: its inference on a shard's batch costs about as much
as stepping the shard), PPO 8 epochs x 8 minibatches, trajectories not stored, no eval and no checkpoint inside the
measured window. Every setting gets a fresh Runner (new run id, resident state released afterwards) on the same
cluster; `--warmup` steps (1), then `--steps` (5) measured steps.

Measured (driver side): "step wall" = median time between consecutive `Runner.train_step()` returns over the
measured steps (with max_staleness=1 this is the steady-state period: rollout n+1 overlaps update n);
"env steps/s" = num_envs * T / step wall; "rollout" and "update" = medians of the step's `time/rollout_total_max`
(slowest shard's env+inference seconds inside its nodes) and `time/update`. Ratios are printed at the end:
disaggregated / colocated, p=2 / p=1 (disaggregated), k=1 / k=0 (colocated and disaggregated), as env-steps/s
ratios (> 1: faster).

Where measured: the development machine of this project, 2 CPU cores, no GPU (the logical GPU worker is a CPU
process), 2026-11-29 20:35-20:48, while two other training runs loaded both cores (load average 8-9): absolute
numbers are low and noisy (a first run at load ~12 gave k=1/k=0 colocated 1.30, disaggregated/colocated 0.77,
p=2/p=1 0.94), and with 3 worker processes on 2 busy cores there is little idle capacity for any overlap to use:

    colocated        step wall 15.59 s |  51.3 env steps/s | rollout 3.05 s, update 11.25 s
    colocated k=1    step wall 10.87 s |  73.6 env steps/s | rollout 3.71 s, update 10.79 s
    disagg p=1       step wall 17.23 s |  46.4 env steps/s | rollout 4.35 s, update 10.65 s
    disagg p=2       step wall 18.82 s |  42.5 env steps/s | rollout 5.45 s, update  6.10 s
    disagg p=1 k=1   step wall 17.65 s |  45.3 env steps/s | rollout 2.52 s, update 12.03 s
    disagg p=2 k=1   step wall 22.73 s |  35.2 env steps/s | rollout 5.52 s, update 14.07 s
    ratios: disaggregated/colocated 0.90, p=2/p=1 0.92, k=1/k=0 colocated 1.43, disaggregated p=1 0.98, p=2 0.83

The same script on the idle machine, 2026-11-29 23:21-23:33, with the phases on separate cores (1 env worker +
the GPU worker, `--num-shards 1 --env-workers 1`), so that overlap has a core to use:

    --num-envs 32 --chunk-steps 20 --hidden 2048 --steps 3 (PPO 8 x 8; the update's time varied 2.6-12.5 s between
    settings for the same work, so these step walls are dominated by update noise):
    colocated        step wall 11.74 s |  54.5 env steps/s | rollout 1.55 s, update  9.99 s
    colocated k=1    step wall  2.61 s | 245.5 env steps/s | rollout 1.42 s, update  2.57 s
    disagg p=1       step wall  7.72 s |  82.9 env steps/s | rollout 1.35 s, update  6.08 s
    disagg p=2       step wall 13.88 s |  46.1 env steps/s | rollout 1.89 s, update 12.49 s
    --num-envs 128 --chunk-steps 10 --hidden 3072 --steps 3 --set algorithm.update_epochs=1
    algorithm.num_minibatches=1 (inference on 128 envs ~ stepping them; a light update):
    disagg p=1       step wall  6.96 s | 183.9 env steps/s | rollout 3.10 s, update 3.64 s
    disagg p=2       step wall  5.95 s | 215.2 env steps/s | rollout 3.67 s, update 3.65 s
    ratio p=2 / p=1: 1.17 per step; the rollout phase alone (step wall - update) 3.3 s -> 2.3 s = 1.43x

Reading: with k=1 and colocated inference the rollout hides behind the update (step wall = update time), the one
clear gain here. With disaggregated inference k=1 gains nothing: the rollout's policy_infer nodes need the same
single-threaded `GPU=1` worker as actor_update, so they queue behind it. p=2 doubles the nodes per step (here
2 x 50 x 3 = 300) against ~15 ms of scheduling each and finds no idle core to overlap on when 3 worker processes
share 2 cores; with one env worker and the inference worker on a core each and chunk-step nodes of ~0.15 s, the
stages overlap: 1.43x on the rollout phase, 1.17x per step (the update, a third of the step, is not pipelined).
The 1.3x per-step target needs inference on its own device (a real GPU) and an update that is a smaller share of
the step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SETTINGS: dict[str, list[str]] = {
    "colocated": ["rollout.inference=colocated"],
    "colocated k=1": ["rollout.inference=colocated", "runner.max_staleness=1"],
    "disagg p=1": ["rollout.inference=disaggregated"],
    "disagg p=2": ["rollout.inference=disaggregated", "rollout.pipeline_stage_num=2"],
    "disagg p=1 k=1": ["rollout.inference=disaggregated", "runner.max_staleness=1"],
    "disagg p=2 k=1": ["rollout.inference=disaggregated", "rollout.pipeline_stage_num=2", "runner.max_staleness=1"],
}
RATIOS = [("disaggregated / colocated", "disagg p=1", "colocated"),
          ("p=2 / p=1 (disaggregated)", "disagg p=2", "disagg p=1"),
          ("k=1 / k=0 (colocated)", "colocated k=1", "colocated"),
          ("k=1 / k=0 (disaggregated p=1)", "disagg p=1 k=1", "disagg p=1"),
          ("k=1 / k=0 (disaggregated p=2)", "disagg p=2 k=1", "disagg p=2")]


def base_overrides(args, run_root: str) -> list[str]:
    hidden = ",".join([str(args.hidden)] * 3)
    return [f"env.num_envs={args.num_envs}", f"env.num_shards={args.num_shards}",
            f"cluster.num_env_workers={args.env_workers}", f"rollout.chunk_steps={args.chunk_steps}",
            f"rollout.chunk_steps_per_node={args.chunk_steps}", f"policy.hidden_sizes=[{hidden}]",
            f"runner.max_steps={args.warmup + args.steps}", "runner.val_check_interval=100000",
            "runner.save_interval=100000", "runner.progress=false", "storage.save_trajectories=false",
            f"run_root={run_root}", "cluster.dashboard_address=127.0.0.1:0", "experiment=bench_distributed",
            *args.set]


def settings_overrides(base: list[str], setting: list[str]) -> list[str]:
    """`base` + one setting's overrides; disaggregated settings drop rollout.chunk_steps_per_node (it sizes the
    colocated env_step nodes only, and a key that does nothing is refused: pipelines.config.check_given)."""
    if "rollout.inference=disaggregated" in setting:
        base = [o for o in base if not o.startswith("rollout.chunk_steps_per_node=")]
    return [*base, *setting]


def measure(handle, overrides: list[str], args) -> dict:
    """Run warm-up + measured steps of one setting on the cluster; return its figures."""
    from pipelines.config import load_config
    from pipelines.runner import Runner
    from tasks import resident
    cfg, _ = load_config(overrides)
    runner = Runner(cfg, handle, echo=lambda *a: None)
    try:
        ends, ms = [], []
        for _ in range(args.warmup + args.steps):
            ms.append(runner.train_step())
            ends.append(time.perf_counter())
        walls = [b - a for a, b in zip(ends[args.warmup - 1:], ends[args.warmup:])] if args.warmup else \
            [m["time/step"] for m in ms]
        measured = ms[args.warmup:]
        env_steps = cfg.env.num_envs * cfg.rollout.chunk_steps * cfg.policy.num_action_chunks
        wall = statistics.median(walls)
        return {"wall": wall, "sps": env_steps / wall,
                "rollout": statistics.median(m["time/rollout_total_max"] for m in measured),
                "update": statistics.median(m["time/update"] for m in measured),
                "staleness": statistics.mean(m.get("train/staleness", 0.0) for m in measured)}
    finally:
        runner.sched.cancel_pipeline()
        runner.tracker.set_terminated("FINISHED")
        handle.client.run(resident.release, f"{runner.state.run_id}/", on_error="ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--chunk-steps", type=int, default=50)
    ap.add_argument("--num-shards", type=int, default=2)
    ap.add_argument("--env-workers", type=int, default=2, help="env workers (CPU=1 each) of the embedded cluster")
    ap.add_argument("--hidden", type=int, default=1024, help="width of the MLP policy's 3 hidden layers")
    ap.add_argument("--only", nargs="*", default=None, help=f"settings to run, of {list(SETTINGS)}")
    ap.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE overrides for every setting")
    args = ap.parse_args()
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    for name in ("mani_skill", "distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from pipelines.clusters import start_cluster
    from pipelines.config import load_config
    names = args.only or list(SETTINGS)
    with tempfile.TemporaryDirectory(prefix="dagrl-bench-dist-") as root:
        base = base_overrides(args, root)
        cfg, _ = load_config(base)
        print(f"benchmarks/schedules.py: {cfg.env.env_id} {cfg.env.obs_mode}, {cfg.env.num_envs} envs in "
              f"{cfg.env.num_shards} shards on {cfg.cluster.num_env_workers} env workers, T={cfg.rollout.chunk_steps}, "
              f"mlp {cfg.policy.hidden_sizes}, "
              f"{args.warmup} warm-up + {args.steps} measured steps per setting; {os.cpu_count()} CPUs, "
              f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
        handle = start_cluster(cfg)
        res: dict[str, dict] = {}
        try:
            for name in names:
                t0 = time.perf_counter()
                res[name] = r = measure(handle, settings_overrides(base, SETTINGS[name]), args)
                print(f"  {name:<16} step wall {r['wall']:6.2f} s | {r['sps']:7.1f} env steps/s | rollout "
                      f"{r['rollout']:5.2f} s, update {r['update']:5.2f} s | staleness {r['staleness']:.1f} | "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            handle.close()
        print("ratios of env steps/s (> 1: faster):")
        for label, a, b in RATIOS:
            if a in res and b in res:
                print(f"  {label:<32} {res[a]['sps'] / res[b]['sps']:5.2f}")
        print(f"load average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
