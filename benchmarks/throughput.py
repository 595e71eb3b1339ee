"""Throughput benchmark: raw simulator vs a hand-written PPO baseline vs the dagrl pipeline, on one machine.

    .venv/bin/python benchmarks/throughput.py [--steps N] [--quick]
    .venv/bin/python benchmarks/throughput.py --scaling [--scaling-envs 16 32 64 128] [--scaling-workers 1 2]

All three systems read one config: the default PushCube-v1 experiment (conf/conf/pushcube_ppo.yaml) through
`pipelines.config.load_config` with `env.num_envs=16` (`--num-envs`; the yaml's own default is 64 x 50 chunk steps
since 2026-12-03), `rollout.chunk_steps=100` (the 1 600 samples per step every earlier figure was measured with)
and `rollout.inference=colocated`, plus any `--set KEY=VALUE`: state obs, pd_joint_delta_pos, normalized_dense
reward, physx_cpu, MLP 3x256 policy, T=100 chunk steps (1 action per chunk) per training step, PPO with 8 epochs x
8 minibatches, target_kl 0.1, episodes of 50 steps (terminations ignored as the yaml says).

(a) raw      N = os.cpu_count() processes, each stepping num_envs/N ManiSkill envs through the adapter the
             pipeline uses (tasks.envs.maniskill.adapter.ManiSkillEnv: one env instance per env; its step is
             tasks.envs.maniskill.fast_step's where env.fast_step applies, as in the pipeline, else ManiSkill's
             env.step) with uniform random actions, resetting finished episodes; after a warm-up, a fixed number
             of steps per env from a common start (barrier).
             steps/s = all steps / slowest process's time.
(b) baseline gymnasium AsyncVectorEnv (one subprocess per env, context "forkserver", CPUGymWrapper: ManiSkill's
             ppo_cpu.py recipe, so ManiSkill's own env.step: `--set env.fast_step=false` compares the pipeline
             with the same env step) + an in-process PPO loop written out below with the same policy class
             (tasks.policies.make_policy) and hyper-parameters. steps/s per training iteration =
             num_envs * T / (rollout + update wall time); the median over the measured iterations after 2 warm-up
             iterations.
(c) pipeline `python -m pipelines.run` with the default cluster (2 env workers + 1 GPU worker, colocated inference),
             eval off during the measurement, trajectories stored. steps/s = median over steps 3.. of
             num_envs * T / time/step from MLflow, overhead = median time/overhead_share
             (1 - (max shard rollout time + update time) / step wall time). With steps ahead
             (`--set runner.max_staleness=1`) steps overlap (an overlapped step's time/step counts from the
             previous step's end; before 2026-12-05 from its submission): steps/s = the env steps of steps 3.. /
             the wall time from step 2's MLflow log to the last step's (MLflow logging included; before
             2026-12-05 this row took the per-step median, which over-counted, e.g. 2521 against 1563 env steps/s
             end to end in one run).

The machine's limit ("bound" line): the raw simulator's CPU time for one training step's env steps on all cores
plus the update's CPU time, spread over all cores with nothing idle: per_step / (per_step / raw steps/s +
update CPU-s / cores). No schedule of these two workloads on this machine can beat it.

`--scaling`: (a) and (c) only, for every env count in --scaling-envs (raw) and every (env count, env workers) pair
(pipeline: `env.num_envs=E cluster.num_env_workers=W env.num_shards=W`), 3 measured steps each: env steps/s,
steps per CPU-second and peak memory per row.

Each system runs in its own process tree (a fresh interpreter), and this driver samples the summed RSS of that
tree every 0.25 s: "peak memory" is the maximum over the system's whole life (start-up included). RSS sums count
shared pages once per process, the same way for every system.

The machine may be shared: "other load" is the CPU time that processes outside the measured tree used during its
phase, as a share of all cores (0 % = a clean measurement), and "steps/CPU-s" divides env steps by the CPU seconds
the measured tree itself spent over the measured window: a figure much less sensitive to other load than steps/s.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WARMUP_STEPS = 2  # training steps excluded from (b) and (c), as the brief's "excluding the first 2 steps"
TARGETS = {"pipeline/baseline": 1.5, "pipeline/raw": 0.8, "overhead": 0.05}  # issue 13: overhead share < 5 %


def _quiet() -> None:
    import logging
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    for name in ("mani_skill", "distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def bench_overrides(args) -> list[str]:
    """Config overrides every system is measured with (on top of conf/conf/pushcube_ppo.yaml)."""
    return [f"env.num_envs={args.num_envs}", "rollout.chunk_steps=100", "rollout.inference=colocated", *args.set]


def _config(overrides: list[str], components: bool = True):
    from pipelines.config import load_config
    cfg, _ = load_config(overrides, components=components)
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# (a) raw simulator
# ---------------------------------------------------------------------------------------------------------------
def _raw_worker(rank: int, n_envs: int, warmup: int, steps: int, overrides: list[str], barrier, queue) -> None:
    _quiet()
    import numpy as np
    import torch
    torch.set_num_threads(1)
    from tasks.envs import make_single_env
    from tasks.seeding import raw_env_seed
    cfg = _config(overrides)
    ignore_term = cfg.env.ignore_terminations
    envs = [make_single_env(cfg.env) for _ in range(n_envs)]  # the adapter the pipeline steps (env.fast_step)
    rng = np.random.default_rng(rank)
    seed = 0  # resets so far in this process (tasks.seeding.raw_env_seed)
    for e in envs:
        e.reset(raw_env_seed(rank, seed))
        seed += 1
    D = envs[0].action_dim

    def run(n: int) -> int:
        nonlocal seed
        resets = 0
        for _ in range(n):
            for e in envs:
                _, _, term, trunc, _ = e.step(rng.uniform(-1, 1, D).astype(np.float32))
                if trunc or (term and not ignore_term):
                    e.reset(raw_env_seed(rank, seed))
                    seed += 1
                    resets += 1
        return resets

    run(warmup)
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    resets = run(steps)
    queue.put({"rank": rank, "steps": steps * n_envs, "seconds": time.perf_counter() - t0,
               "cpu_s": time.process_time() - c0, "resets": resets})
    for e in envs:
        e.close()


def phase_raw(args) -> dict:
    import multiprocessing as mp
    from tasks.envs.maniskill.vulkan import ensure_vulkan
    ensure_vulkan()
    overrides = bench_overrides(args)
    cfg = _config(overrides)
    n_proc = os.cpu_count() or 1
    B = cfg.env.num_envs
    sizes = [B // n_proc + (1 if r < B % n_proc else 0) for r in range(n_proc)]
    sizes = [s for s in sizes if s > 0]
    ctx = mp.get_context("forkserver")
    barrier, queue = ctx.Barrier(len(sizes)), ctx.Queue()
    procs = [ctx.Process(target=_raw_worker, args=(r, s, args.raw_warmup, args.raw_steps, overrides, barrier, queue))
             for r, s in enumerate(sizes)]
    for p in procs:
        p.start()
    res = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    steps = sum(r["steps"] for r in res)
    secs = max(r["seconds"] for r in res)
    cpu = sum(r["cpu_s"] for r in res)
    return {"processes": len(sizes), "envs_per_process": sizes, "steps": steps, "seconds": secs,
            "steps_per_s": steps / secs, "cpu_s": cpu, "steps_per_cpu_s": steps / cpu, "resets": sum(r["resets"] for r in res)}


# ---------------------------------------------------------------------------------------------------------------
# (b) hand-written baseline: AsyncVectorEnv + in-process PPO
# ---------------------------------------------------------------------------------------------------------------
def _make_cpu_env(env_id: str, kwargs: dict, ignore_terminations: bool):
    """One subprocess env, ManiSkill's CPU recipe: gym.make(num_envs=1, physx_cpu) + CPUGymWrapper."""
    _quiet()
    import torch
    torch.set_num_threads(1)
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper
    return CPUGymWrapper(gym.make(env_id, **kwargs), ignore_terminations=ignore_terminations)


def hand_written_ppo_update(a, policy, opt, obs, act, logp, adv, ret) -> int:
    """System (b)'s PPO update on flattened samples: obs [N, O], act [N, 1, D], logp [N] (summed over the chunk),
    adv / ret [N]; epochs x minibatches of the clipped surrogate + value loss, KL early stop on the joint ratio.
    Leaves `policy` in train mode; returns the Adam steps taken."""
    import torch
    N = obs.shape[0]
    if a.normalize_advantages:
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    mb, updates = N // a.num_minibatches, 0
    policy.train()
    for _ in range(a.update_epochs):
        perm = torch.randperm(N)
        for i in range(a.num_minibatches):
            idx = perm[i * mb:(i + 1) * mb]
            ev = policy.evaluate({"state": obs[idx]}, act[idx])
            logratio = ev["logprobs"].sum((1, 2)) - logp[idx]
            ratio = logratio.exp()
            clipped = ratio.clamp(1 - a.clip_ratio_low, 1 + a.clip_ratio_high)
            pg = torch.max(-adv[idx] * ratio, -adv[idx] * clipped).mean()
            v_loss = 0.5 * ((ev["values"].reshape(-1) - ret[idx]) ** 2).mean()
            loss = pg + a.value_coef * v_loss - a.entropy_coef * ev["entropy"].sum((1, 2)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), a.max_grad_norm)
            opt.step()
            updates += 1
            with torch.no_grad():
                kl = ((ratio - 1) - logratio).mean().item()
            if a.target_kl is not None and kl > a.target_kl:
                return updates
    return updates


def phase_baseline(args) -> dict:
    from functools import partial

    import gymnasium as gym
    import numpy as np
    import torch
    from tasks.envs.maniskill.vulkan import ensure_vulkan
    from tasks.policies import make_policy
    from tasks.seeding import episode_seed, model_init_seed

    ensure_vulkan()  # before the forkserver starts: the env subprocesses inherit VK_ICD_FILENAMES
    cfg = _config(bench_overrides(args))
    e, a = cfg.env, cfg.algorithm
    B, T = e.num_envs, cfg.rollout.chunk_steps
    kwargs = dict(obs_mode=e.obs_mode, control_mode=e.control_mode, reward_mode=e.reward_mode,
                  sim_backend="physx_cpu", render_mode=None, num_envs=1)
    if e.max_episode_steps:
        kwargs["max_episode_steps"] = e.max_episode_steps
    t_start = time.perf_counter()
    fns = [partial(_make_cpu_env, e.env_id, kwargs, e.ignore_terminations) for _ in range(B)]
    envs = gym.vector.AsyncVectorEnv(fns, context="forkserver", autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs, _ = envs.reset(seed=[episode_seed(e.seed, i, 0, B) for i in range(B)])  # episode 0 of each env
    t_envs = time.perf_counter() - t_start
    O, D = envs.single_observation_space.shape[0], envs.single_action_space.shape[0]
    policy = make_policy(cfg.policy, obs_dim=O, action_dim=D, seed=model_init_seed(cfg.seed))
    opt = torch.optim.Adam(policy.parameters(), lr=a.lr, eps=1e-5)
    obs = torch.as_tensor(obs, dtype=torch.float32)

    iters = []
    cpu0 = 0.0
    for it in range(WARMUP_STEPS + args.steps):
        if it == WARMUP_STEPS:
            cpu0 = tree_cpu_s(os.getpid())
        # ---- rollout: T steps of all B envs, inference in this process ----
        t0 = time.perf_counter()
        b_obs, b_act = torch.zeros(T, B, O), torch.zeros(T, B, 1, D)
        b_logp, b_val, b_rew = torch.zeros(T, B), torch.zeros(T, B), torch.zeros(T, B)
        b_done, b_final = torch.zeros(T, B), torch.zeros(T, B)  # done = term|trunc; V(final obs) where truncated
        for t in range(T):
            out = policy.act({"state": obs})  # no_grad inside
            b_obs[t], b_act[t] = obs, out["actions"]
            b_logp[t], b_val[t] = out["logprobs"].sum((1, 2)), out["values"]
            nobs, rew, term, trunc, info = envs.step(out["actions"][:, 0].clamp(-1, 1).numpy())
            b_rew[t] = torch.as_tensor(rew, dtype=torch.float32) * a.reward_scale
            done = term | trunc
            b_done[t] = torch.as_tensor(done, dtype=torch.float32)
            tr = np.flatnonzero(trunc & ~term)
            if len(tr):
                fo = torch.as_tensor(np.stack([info["final_obs"][i] for i in tr]), dtype=torch.float32)
                with torch.no_grad():
                    b_final[t, tr] = policy.values({"state": fo}).reshape(-1)
            obs = torch.as_tensor(nobs, dtype=torch.float32)
        with torch.no_grad():
            next_v = policy.values({"state": obs}).reshape(-1)
        t_roll = time.perf_counter() - t0
        # ---- GAE (truncated episodes bootstrap from V(final obs)) ----
        t1 = time.perf_counter()
        adv = torch.zeros(T, B)
        last = torch.zeros(B)
        for t in reversed(range(T)):
            nv = next_v if t == T - 1 else b_val[t + 1]
            nd = b_done[t]
            delta = b_rew[t] + a.gamma * ((1 - nd) * nv + b_final[t]) - b_val[t]
            last = delta + a.gamma * a.gae_lambda * (1 - nd) * last
            adv[t] = last
        ret = adv + b_val
        # ---- PPO update: epochs x minibatches, clipped surrogate + value loss, KL early stop ----
        N = T * B
        f_obs, f_act, f_logp = b_obs.reshape(N, O), b_act.reshape(N, 1, D), b_logp.reshape(N)
        f_adv, f_ret = adv.reshape(N), ret.reshape(N)
        updates = hand_written_ppo_update(a, policy, opt, f_obs, f_act, f_logp, f_adv, f_ret)
        policy.eval()
        t_upd = time.perf_counter() - t1
        iters.append({"rollout": t_roll, "update": t_upd, "steps_per_s": N / (t_roll + t_upd),
                      "minibatch_updates": updates, "reward_mean": float(b_rew.mean())})
        print(f"  baseline iter {it + 1}/{WARMUP_STEPS + args.steps}: rollout {t_roll:.2f}s update {t_upd:.2f}s "
              f"-> {N / (t_roll + t_upd):.0f} steps/s", flush=True)
    cpu = tree_cpu_s(os.getpid()) - cpu0  # this process + the env subprocesses, over the measured iterations
    envs.close()
    m = iters[WARMUP_STEPS:]
    return {"env_start_s": t_envs, "iterations": iters, "cpu_s": cpu, "steps_per_cpu_s": len(m) * B * T / cpu,
            "steps_per_s": statistics.median(x["steps_per_s"] for x in m),
            "steps_per_s_total": len(m) * B * T / sum(x["rollout"] + x["update"] for x in m),
            "rollout_s": statistics.median(x["rollout"] for x in m),
            "update_s": statistics.median(x["update"] for x in m)}


# ---------------------------------------------------------------------------------------------------------------
# (c) the dagrl pipeline, from MLflow
# ---------------------------------------------------------------------------------------------------------------
PIPE_KEYS = ("rollout/env_steps_per_s", "rollout/env_steps_total", "time/step", "time/rollout_total_max",
             "time/update", "time/overhead_share", "time/store_max", "train/minibatch_updates")


def pipeline_overrides(args, run_root: str) -> list[str]:
    steps = args.steps
    return [*bench_overrides(args), f"runner.max_steps={steps + WARMUP_STEPS}", "runner.val_check_interval=1000000",
            "runner.save_interval=1000000", "runner.max_wall_time_s=null", "runner.progress=false",
            f"run_root={run_root}", "cluster.dashboard_address=127.0.0.1:0", "storage.save_trajectories=true"]


def read_pipeline_metrics(run_root: str) -> dict:
    import sqlite3
    con = sqlite3.connect(Path(run_root) / "mlflow.db")
    rows = con.execute("SELECT step, key, value, timestamp FROM metrics WHERE key IN (%s) ORDER BY step, timestamp"
                       % ",".join("?" * len(PIPE_KEYS)), PIPE_KEYS).fetchall()
    con.close()
    per: dict[int, dict] = {}
    for step, key, value, ts in rows:
        per.setdefault(step, {})[key] = value
        per[step]["_ts"] = ts / 1000.0
    steps = sorted(per)
    m = [per[s] for s in steps if s > WARMUP_STEPS]
    if not m:
        raise RuntimeError(f"no pipeline steps after the first {WARMUP_STEPS} in {run_root}/mlflow.db")
    # wall time between consecutive metric logs: the whole loop iteration, MLflow logging included
    loop = [per[s]["_ts"] - per[s - 1]["_ts"] for s in steps if s > WARMUP_STEPS and s - 1 in per]
    # with steps ahead (runner.max_staleness > 0; no time/overhead_share logged) a step's time/step runs from its
    # submission to its end and overlaps its neighbours': env steps / time/step is no throughput. There the figure
    # is the measured window's: env steps of steps WARMUP+1.. over the wall time from step WARMUP's log to the last
    overlapped = all(math.isnan(x.get("time/overhead_share", float("nan"))) for x in m)
    if overlapped and WARMUP_STEPS in per and len(m) > 1:
        window_env_steps = per[steps[-1]]["rollout/env_steps_total"] - per[WARMUP_STEPS]["rollout/env_steps_total"]
        steps_per_s = window_env_steps / (per[steps[-1]]["_ts"] - per[WARMUP_STEPS]["_ts"])
    else:
        steps_per_s = statistics.median(x["rollout/env_steps_per_s"] for x in m)
    return {"steps": {s: {k: v for k, v in per[s].items()} for s in steps},
            "steps_per_s": steps_per_s, "overlapped": overlapped,
            # logged by synchronous runs only (with steps ahead the update overlaps the next rollout): nan
            "overhead_share": statistics.median(x.get("time/overhead_share", float("nan")) for x in m),
            "step_s": statistics.median(x["time/step"] for x in m),
            "rollout_s": statistics.median(x["time/rollout_total_max"] for x in m),
            "update_s": statistics.median(x["time/update"] for x in m),
            "store_s": statistics.median(x.get("time/store_max", float("nan")) for x in m),
            "loop_s": statistics.median(loop) if loop else float("nan")}


def pipeline_cpu(p: dict) -> tuple[float, float]:
    """CPU seconds of the pipeline's process tree between the MLflow logs of step WARMUP_STEPS and the last step,
    and the env steps in that window."""
    steps = sorted(p["steps"])
    t_a, t_b = p["steps"][WARMUP_STEPS]["_ts"], p["steps"][steps[-1]]["_ts"]

    def at(t: float) -> float:
        return min(p["cpu_trace"], key=lambda x: abs(x[0] - t))[1]
    total = "rollout/env_steps_total"
    env_steps = p["steps"][steps[-1]][total] - p["steps"][WARMUP_STEPS][total]
    return at(t_b) - at(t_a), env_steps


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------
def tree_cpu_s(pid: int) -> float:
    """User+system CPU seconds of process `pid` and its live descendants."""
    import psutil
    total = 0.0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all cores; hypervisor steal counts as busy)."""
    import psutil
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def run_tree(cmd: list[str], log: Path, timeout: float) -> dict:
    """Run `cmd` (stdout+stderr to `log`), sampling its process tree every 0.25 s.

    Returns rc, phase_s, peak_gib (max summed RSS of the tree), cpu_trace [(unix time, tree CPU seconds)] and
    other_load: CPU time spent by processes outside the tree during the run, as a share of the machine (0 = the
    system had the machine to itself).
    """
    import psutil
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    t0, busy0 = time.perf_counter(), _busy_s()
    peak = 0
    cpu: dict[int, float] = {}  # pid -> last seen user+system seconds of each process of the tree
    cpu_trace: list[tuple[float, float]] = []  # (unix time, CPU seconds of the tree so far)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    with p.oneshot():
                        total += p.memory_info().rss
                        ct = p.cpu_times()
                        cpu[p.pid] = ct.user + ct.system
                except psutil.Error:
                    pass
            peak = max(peak, total)
            cpu_trace.append((time.time(), sum(cpu.values())))
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                break
            time.sleep(0.25)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    other = max(0.0, (_busy_s() - busy0) - sum(cpu.values())) / (wall * (os.cpu_count() or 1))
    return {"rc": rc, "phase_s": wall, "peak_gib": peak / 2**30, "other_load": other, "cpu_trace": cpu_trace}


def other_pipeline_runs() -> list[str]:
    import psutil
    me = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "pipelines.run" in cmd and p.info["pid"] not in me:
            out.append(f"pid {p.info['pid']}")
    return out


def actor_threads(cfg) -> int:
    """Torch threads of the pipeline's actor worker (pipelines.clusters.local.cluster_specs' rule): the update's CPU
    seconds per wall second, at most."""
    return cfg.cluster.actor_threads or max(1, (os.cpu_count() or 1) - cfg.cluster.num_env_workers)


def machine_bound(per_step: int, raw_sps: float, update_cpu_s: float, cores: int) -> float:
    """Env steps/s no schedule can beat on this machine: a step's env steps at the raw simulator's rate on all
    cores (per_step / raw_sps wall seconds = that many x cores CPU-s) plus the update's CPU seconds, all cores busy.

    >>> round(machine_bound(1600, 1600.0, 1.0, 2))  # 1 s of env on 2 cores + 1 CPU-s of update over 2 cores
    1067
    """
    return per_step / (per_step / raw_sps + update_cpu_s / cores)


def scaling(args, scratch: Path, t_all: float) -> None:
    """The scaling table (--scaling): raw per env count, the pipeline per (env count, env workers)."""
    py, me = sys.executable, str(Path(__file__).resolve())
    rows = []
    for E in args.scaling_envs:
        out, log = scratch / f"raw{E}.json", scratch / f"raw{E}.log"
        tree = run_tree([py, me, "--phase", "raw", "--out", str(out), "--num-envs", str(E),
                         *(f"--set={o}" for o in args.set), *(["--quick"] if args.quick else [])], log, timeout=900)
        if tree["rc"] != 0 or not out.exists():
            _fail(f"raw {E} envs", tree["rc"], log)
        raw = {**json.loads(out.read_text()), **tree}
        rows.append((E, f"raw, {raw['processes']} procs", raw))
        print(f"[{time.perf_counter() - t_all:5.0f}s] raw {E} envs: {raw['steps_per_s']:.0f} env steps/s", flush=True)
        for W in args.scaling_workers:
            if E % W:
                continue
            run_root = scratch / f"pipe{E}_{W}"
            a = argparse.Namespace(**{**vars(args), "num_envs": E,
                                      "set": [*args.set, f"cluster.num_env_workers={W}", f"env.num_shards={W}"]})
            log = scratch / f"pipe{E}_{W}.log"
            tree = run_tree([py, "-m", "pipelines.run", *pipeline_overrides(a, str(run_root))], log, timeout=1800)
            if tree["rc"] != 0:
                _fail(f"pipeline {E} envs {W} workers", tree["rc"], log)
            p = {**read_pipeline_metrics(str(run_root)), **tree}
            p["cpu_s"], p["env_steps"] = pipeline_cpu(p)
            p["steps_per_cpu_s"] = p["env_steps"] / p["cpu_s"]
            rows.append((E, f"pipeline, {W} env worker{'s' if W > 1 else ''}", p))
            print(f"[{time.perf_counter() - t_all:5.0f}s] pipeline {E} envs {W} workers: {p['steps_per_s']:.0f} "
                  f"env steps/s", flush=True)
    print(f"\n{'envs':>5}  {'system':<28}{'env steps/s':>12}{'steps/CPU-s':>13}{'peak GiB':>10}{'other load':>12}"
          f"{'update s':>10}")
    for E, name, x in rows:
        upd = f"{x['update_s']:.2f}" if "update_s" in x else ""
        print(f"{E:>5}  {name:<28}{x['steps_per_s']:>12.0f}{x['steps_per_cpu_s']:>13.0f}{x['peak_gib']:>10.2f}"
              f"{100 * x['other_load']:>11.0f}%{upd:>10}")
    print(f"\ntotal {time.perf_counter() - t_all:.0f}s | load avg {os.getloadavg()[0]:.2f}")
    for _, _, x in rows:
        x.pop("cpu_trace", None)
    (scratch / "scaling.json").write_text(json.dumps([(E, n, x) for E, n, x in rows], indent=1, default=str))


def _fail(name: str, rc: int, log: Path) -> None:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    sys.exit(f"{name} failed (exit {rc}); last lines of {log}:\n{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"measured training steps per system, after {WARMUP_STEPS} warm-up steps (default 8)")
    ap.add_argument("--quick", action="store_true", help="smoke check: 1 measured step, short raw run")
    ap.add_argument("--num-envs", type=int, default=16, help="envs per system (default 16; the default job trains 64)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for all three systems (repeatable), e.g. --set env.num_shards=4")
    ap.add_argument("--scaling", action="store_true",
                    help="scaling table: raw and pipeline for every --scaling-envs x --scaling-workers")
    ap.add_argument("--scaling-envs", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--scaling-workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--phase", choices=["raw", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, pipeline run dir)")
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 1 if args.quick else (3 if args.scaling else 8)
    args.raw_warmup, args.raw_steps = (10, 60) if args.quick else (30, 400)

    if args.phase:  # a child: measure one system, write JSON
        _quiet()
        res = phase_raw(args) if args.phase == "raw" else phase_baseline(args)
        Path(args.out).write_text(json.dumps(res))
        return

    import platform
    import shutil
    scratch = Path(tempfile.mkdtemp(prefix="dagrl-bench-"))
    busy = other_pipeline_runs()
    cores = os.cpu_count()
    print(f"dagrl throughput benchmark | {time.strftime('%Y-%m-%d %H:%M')} | {platform.node()} {cores} cores | "
          f"load avg {os.getloadavg()[0]:.2f} | measured steps {args.steps} (+{WARMUP_STEPS} warm-up) | "
          f"scratch {scratch}", flush=True)
    if busy:
        print(f"WARNING: another pipelines.run is running ({', '.join(busy)}): figures are CPU-contended", flush=True)
    t_all = time.perf_counter()
    py = sys.executable
    me = str(Path(__file__).resolve())
    results: dict = {}
    if args.scaling:
        scaling(args, scratch, t_all)
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
        return

    for name, label in (("raw", "(a) raw simulator"), ("baseline", "(b) hand-written AsyncVectorEnv + PPO")):
        print(f"[{time.perf_counter() - t_all:5.0f}s] {label} ...", flush=True)
        out, log = scratch / f"{name}.json", scratch / f"{name}.log"
        tree = run_tree([py, me, "--phase", name, "--out", str(out), "--steps", str(args.steps),
                         "--num-envs", str(args.num_envs), *(f"--set={o}" for o in args.set),
                         *(["--quick"] if args.quick else [])], log, timeout=900)
        if tree["rc"] != 0 or not out.exists():
            _fail(label, tree["rc"], log)
        results[name] = {**json.loads(out.read_text()), **tree}
        print(f"[{time.perf_counter() - t_all:5.0f}s] {label}: {results[name]['steps_per_s']:.0f} env steps/s, "
              f"peak {tree['peak_gib']:.2f} GiB, phase {tree['phase_s']:.0f}s, "
              f"other CPU load {100 * tree['other_load']:.0f}%", flush=True)

    label = "(c) dagrl pipeline"
    print(f"[{time.perf_counter() - t_all:5.0f}s] {label} ...", flush=True)
    run_root = scratch / "pipeline"
    ovr = pipeline_overrides(args, str(run_root))
    log = scratch / "pipeline.log"
    tree = run_tree([py, "-m", "pipelines.run", *ovr], log, timeout=900)
    if tree["rc"] != 0:
        _fail(label, tree["rc"], log)
    results["pipeline"] = p = {**read_pipeline_metrics(str(run_root)), **tree}
    p["cpu_s"], p["env_steps"] = pipeline_cpu(p)
    p["steps_per_cpu_s"] = p["env_steps"] / p["cpu_s"]
    share = "-" if math.isnan(p["overhead_share"]) else f"{100 * p['overhead_share']:.1f}%"
    print(f"[{time.perf_counter() - t_all:5.0f}s] {label}: {p['steps_per_s']:.0f} env steps/s, overhead "
          f"{share}, peak {tree['peak_gib']:.2f} GiB, phase {tree['phase_s']:.0f}s, "
          f"other CPU load {100 * tree['other_load']:.0f}%", flush=True)

    # ---- report ----
    r, b = results["raw"], results["baseline"]
    cfg = _config(bench_overrides(args), components=False)
    print()
    print(f"command: python -m pipelines.run {' '.join(ovr)}")
    print(f"{'system':<44}{'env steps/s':>12}{'rollout s':>11}{'update s':>10}{'peak GiB':>10}{'other load':>12}"
          f"{'steps/CPU-s':>13}")
    rows = [(f"(a) raw sim, {r['processes']} procs x {r['envs_per_process'][0]} envs, random", r, "", ""),
            (f"(b) AsyncVectorEnv({cfg.env.num_envs}) + in-process PPO", b, f"{b['rollout_s']:.2f}",
             f"{b['update_s']:.2f}"),
            ("(c) dagrl pipeline (2 env + 1 GPU worker)", p, f"{p['rollout_s']:.2f}", f"{p['update_s']:.2f}")]
    for name, x, roll, upd in rows:
        print(f"{name:<44}{x['steps_per_s']:>12.0f}{roll:>11}{upd:>10}{x['peak_gib']:>10.2f}"
              f"{100 * x['other_load']:>11.0f}%{x['steps_per_cpu_s']:>13.0f}")
    per_step = cfg.env.num_envs * cfg.rollout.chunk_steps * cfg.policy.num_action_chunks
    print(f"    pipeline step {p['step_s']:.2f}s (median; trajectory store {p['store_s']:.2f}s inside); full loop "
          f"iteration incl. MLflow logging {p['loop_s']:.2f}s -> {per_step / p['loop_s']:.0f} env steps/s end to end")
    overlapped = cfg.runner.max_staleness > 0  # the update of step n runs beside the rollout of step n + 1
    print(f"    while rolling out, the pipeline steps {per_step / p['rollout_s']:.0f} env steps/s "
          f"({100 * per_step / p['rollout_s'] / r['steps_per_s']:.0f}% of raw); the update ({p['update_s']:.2f}s) "
          + (f"overlaps the next rollout (runner.max_staleness={cfg.runner.max_staleness})" if overlapped else
             f"follows the rollout, {100 * p['update_s'] / p['step_s']:.0f}% of the step"))
    ratios = [("pipeline / hand-written", p["steps_per_s"] / b["steps_per_s"], f">= {TARGETS['pipeline/baseline']}x",
               p["steps_per_s"] / b["steps_per_s"] >= TARGETS["pipeline/baseline"]),
              ("pipeline / raw", p["steps_per_s"] / r["steps_per_s"], f">= {TARGETS['pipeline/raw']}x",
               p["steps_per_s"] / r["steps_per_s"] >= TARGETS["pipeline/raw"])]
    if not overlapped:  # time/overhead_share = 1 - (rollout + update) / step: meaningless once the two overlap
        ratios.append(("overhead share", 100 * p["overhead_share"], f"< {100 * TARGETS['overhead']:.0f} %",
                       p["overhead_share"] < TARGETS["overhead"]))
    print()
    print(f"{'ratio':<26}{'value':>9}  {'target':<10}")
    for name, val, tgt, ok in ratios:
        unit = " %" if name.startswith("overhead") else "x"
        print(f"{name:<26}{val:>8.2f}{unit:<2} {tgt:<10} {'PASS' if ok else 'FAIL'}")
    if overlapped:
        print("overhead share: not measured per step with overlapped updates (the run's end-of-run summary has "
              "`scheduling_overhead`)")
    bound = machine_bound(per_step, r["steps_per_s"], p["update_s"] * actor_threads(cfg), cores)
    print(f"machine bound {bound:.0f} env steps/s (raw on all {cores} cores + the update's "
          f"{p['update_s'] * actor_threads(cfg):.2f} CPU-s per step, nothing idle): the pipeline reaches "
          f"{100 * p['steps_per_s'] / bound:.0f}% of it, the hand-written loop {100 * b['steps_per_s'] / bound:.0f}%")
    loaded = [k for k in ("raw", "baseline", "pipeline") if results[k]["other_load"] > 0.05]
    print(f"\ntotal {time.perf_counter() - t_all:.0f}s"
          + (f" | CONTENDED: {', '.join(busy)} running at start" if busy else "")
          + (f" | other processes used >5% of the CPU during: {', '.join(loaded)}" if loaded else ""))
    print(f"{'(per CPU-second: pipeline / hand-written':<26} {p['steps_per_cpu_s'] / b['steps_per_cpu_s']:.2f}x, "
          f"pipeline / raw {p['steps_per_cpu_s'] / r['steps_per_cpu_s']:.2f}x; no target, less sensitive to other load)")
    for x in results.values():
        x.pop("cpu_trace", None)
    (scratch / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if args.keep:
        print(f"kept {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
