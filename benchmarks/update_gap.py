"""The PPO update alone: dagrl's `tasks.actor.entries.actor_update` against the hand-written loop of
`benchmarks/throughput.py` (b), on the same rollout, in one process, at 1 and 2 torch threads.

    .venv/bin/python benchmarks/update_gap.py [--num-envs 16] [--repeats 5] [--threads 1 2] [--profile]

The rollout is real: the default experiment (conf/conf/pushcube_ppo.yaml, `env.num_envs` envs in 2 shards,
T = 100 chunk steps, as throughput.py pins it) stepped in this process with `tasks.rollout.env_step`, its GAE by
`tasks.actor.entries.advantages`. Both updates then run the config's epochs x minibatches with target_kl, from the same
initial weights, each `--repeats` times (fresh optimizer and weights each time; the figure is the minimum, the
least disturbed by other load). The hand-written loop is the one `benchmarks/throughput.py` times for system (b)
(`throughput.hand_written_ppo_update`: the same formula on the same flattened tensors, no masks, no metrics).

Printed: seconds per update and per Adam step for each (threads, system), the machine's load average, and with
`--profile` the top of a cProfile of one dagrl update (where the extra time goes).

`--dask`: also the same `actor_update` on the same samples inside the pipeline's actor worker: a one-worker
cluster built by `pipelines.clusters.local.cluster_specs` from the same config (the GPU worker's Nanny, its environment
variables and threads exactly as `python -m pipelines.run` starts it), the samples sent once and kept there.
Shown: the function's own `time/update` (what the pipeline logs) for the worker as configured, for the same
worker with Dask's statistical profiler off (`distributed.worker.profile.enabled=False`) and for it spawned
with the `MALLOC_TRIM_THRESHOLD_=65536` that Dask's Nanny puts into every worker's environment by default
(`distributed.nanny.pre-spawn-environ`; the pipeline spawns its workers without it since 2026-12-02:
`pipelines.clusters.local.glibc_malloc_defaults`). The last column counts the process's minor page faults during one
update (`getrusage`), a figure the machine's load does not change.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rollout(num_envs: int, overrides: list[str]):
    """(cfg, initial weights, [advantage dicts per shard]) of one real rollout of the default experiment."""
    import torch
    from pipelines.config import load_config
    from tasks import rollout as ro
    from tasks.actor import entries as update
    from tasks.envs.maniskill.vulkan import ensure_vulkan
    ensure_vulkan()
    torch.set_num_threads(1)
    cfg, _ = load_config([f"env.num_envs={num_envs}", "rollout.chunk_steps=100", "rollout.inference=colocated",
                          *overrides])
    dims = ro.env_dims(cfg)
    w = update.actor_init(cfg, "bench-gap", dims)
    advs = []
    for shard in range(cfg.env.num_shards):
        seg = ro.env_step(cfg, "bench-gap", shard, w, cfg.rollout.chunk_steps, None, first=True, last=True)
        advs.append(update.advantages(cfg, ro.trajectory(seg)))
    return cfg, w, advs


def _faulted_update(cfg, run_id, w, *advs):
    """actor_update and the minor page faults of this process during it (resource.getrusage: ru_minflt)."""
    import resource
    from tasks.actor import entries as update
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = update.actor_update(cfg, run_id, w, *advs)
    return out["metrics"], resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def in_worker(cfg, w, advs, repeats: int, profiler: bool = True, trim: bool = False):
    """(sorted `time/update` of `repeats` (+1 warm-up) actor_update calls, Adam steps per call, median minor page
    faults per call) inside a fresh one-worker cluster that `pipelines.clusters.local.cluster_specs` specifies for `cfg`
    (its GPU worker only, spawned as `pipelines.clusters.start_cluster` spawns it: glibc_malloc_defaults).
    profiler=False: Dask's statistical profiler off in the worker; trim=True: the worker spawned with Dask's own
    MALLOC_TRIM_THRESHOLD_=65536 (what the pipeline did before)."""
    import logging
    import dask
    from distributed import Client, SpecCluster
    from pipelines.clusters.local import MALLOC_TRIM, cluster_specs, glibc_malloc_defaults
    from tasks import resident
    glibc_malloc_defaults()  # as pipelines.clusters.start_cluster
    settings = {"distributed.worker.profile.enabled": profiler}
    if trim:  # Dask's own default
        settings[f"distributed.nanny.pre-spawn-environ.{MALLOC_TRIM}"] = 65536
    with dask.config.set(settings):
        scheduler, workers = cluster_specs(cfg, [("gpu-0", None)])
        workers = {k: v for k, v in workers.items() if k == "gpu-0"}
        if not profiler:
            workers["gpu-0"]["options"]["env"]["DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED"] = "False"
        with SpecCluster(scheduler=scheduler, workers=workers, silence_logs=logging.ERROR) as cluster, \
                Client(cluster) as client:
            futs = client.scatter(list(advs), workers=["gpu-0"])
            wf = client.scatter(w, workers=["gpu-0"])
            out = []
            for i in range(repeats + 1):
                client.run(resident.release, "bench-gap/actor")
                m, faults = client.submit(_faulted_update, cfg, "bench-gap", wf, *futs, pure=False,
                                          workers=["gpu-0"]).result()
                if i:
                    out.append((m["time/update"], int(m["train/minibatch_updates"]), faults))
    return sorted(t for t, _, _ in out), out[0][1], sorted(f for _, _, f in out)[len(out) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--dask", action="store_true", help="also time actor_update inside the pipeline's actor worker")
    args = ap.parse_args()

    import torch
    from tasks import resident
    from tasks.actor import loop
    from tasks.policies import make_policy
    from tasks.seeding import model_init_seed
    from throughput import hand_written_ppo_update  # this folder is on sys.path when run as a script
    t0 = time.perf_counter()
    cfg, w, advs = rollout(args.num_envs, args.set)
    a = cfg.algorithm
    N = sum(x["actions"].shape[0] * x["actions"].shape[1] for x in advs)
    print(f"update gap | {time.strftime('%Y-%m-%d %H:%M')} | {os.cpu_count()} cores | load avg "
          f"{os.getloadavg()[0]:.2f} | N={N} samples, {a.update_epochs} epochs x {a.num_minibatches} minibatches, "
          f"target_kl {a.target_kl} | rollout {time.perf_counter() - t0:.1f}s", flush=True)
    data = loop.flatten(advs)
    O, D = data["obs"].shape[-1], data["actions"].shape[-1]

    def dagrl_once() -> tuple[float, int]:
        resident.release("bench-gap/actor")  # a fresh actor (weights w, new optimizer) each time
        t = time.perf_counter()
        m, faults = _faulted_update(cfg, "bench-gap", w, *advs)
        last_faults[0] = faults
        return time.perf_counter() - t, int(m["train/minibatch_updates"])

    last_faults = [0]

    def base_once() -> tuple[float, int]:
        policy = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=model_init_seed(cfg.seed))
        policy.load_state_dict(w["state_dict"])
        opt = torch.optim.Adam(policy.parameters(), lr=a.lr, eps=1e-5)
        t = time.perf_counter()
        N = data["actions"].shape[0]
        logp = data["logprobs"].reshape(N, -1).sum(-1)  # the chunk's joint log-prob, as (b) stores it
        n = hand_written_ppo_update(a, policy, opt, data["obs"], data["actions"], logp,
                                    data["advantages"].reshape(N), data["returns"].reshape(N))
        return time.perf_counter() - t, n

    def thread_once() -> tuple[float, int]:  # the same call on a second thread of this process, as Dask runs tasks
        import threading
        box = []
        th_ = threading.Thread(target=lambda: box.append(dagrl_once()))
        th_.start()
        th_.join()
        return box[0]

    print(f"{'threads':>7} {'system':<28}{'update s (min)':>15}{'median':>8}{'Adam steps':>11}{'ms/step':>9}{'page faults':>13}")
    for th in args.threads:
        torch.set_num_threads(th)
        for name, fn in (("hand-written loop", base_once), ("dagrl actor_update", dagrl_once),
                         ("dagrl, another thread", thread_once)):
            fn()  # warm-up
            res = [fn() for _ in range(args.repeats)]
            ts = sorted(r[0] for r in res)
            n = res[0][1]
            faults = last_faults[0] if name != "hand-written loop" else ""
            print(f"{th:>7} {name:<28}{ts[0]:>15.3f}{ts[len(ts) // 2]:>8.3f}{n:>11}{1000 * ts[0] / max(n, 1):>9.2f}"
                  f"{faults:>13}", flush=True)
    if args.dask:
        for name, kw in (("actor worker (as run)", {}), ("  worker, no Dask profiler", {"profiler": False}),
                         ("  worker, Dask's MALLOC_TRIM", {"trim": True})):
            ts, n, faults = in_worker(cfg, w, advs, args.repeats, **kw)
            print(f"{'worker':>7} {name:<28}{ts[0]:>15.3f}{ts[len(ts) // 2]:>8.3f}{n:>11}"
                  f"{1000 * ts[0] / max(n, 1):>9.2f}{faults:>13}", flush=True)
    if args.profile:
        torch.set_num_threads(1)
        pr = cProfile.Profile()
        pr.enable()
        dagrl_once()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    print(f"load avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
