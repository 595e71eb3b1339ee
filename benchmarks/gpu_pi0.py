"""pi0 / pi0.5 `base` presets on one GPU with random weights: act latency per env batch, one PPO step (LoRA and full
fine-tuning with gradient checkpointing), update time and peak memory; one table printed, one JSON per row.

    python benchmarks/gpu_pi0.py --out DIR                               # a CUDA machine (H100 / H200): a few minutes
    python benchmarks/gpu_pi0.py --device cpu --preset tiny --out DIR    # dry mode: every code path on the CPU
    bash benchmarks/gpu_pi0.sh                                           # the device machine: this, then pytest -m gpu

Without CUDA (and without --device cpu) it stops at once with exit code 2 and one line saying so; a missing package
(transformers >= 5.25 with PI0ForConditionalGeneration, peft, dask, distributed) likewise, naming it.

One row = a family (pi0, pi05) x a mode (`lora`: policy.lora_rank=16 on the library's Gemma / expert projections,
the heads trained; `full`: every parameter trained, policy.gradient_checkpointing=true), built as the run builds its
actor (tasks.actor.actor.build_actor: the preset's transformers config, random weights created directly on the
device, float32 master weights, policy.dtype=bfloat16 autocast on CUDA; the tokenizer is the tiny byte-level one
tasks.policies.pi0.processor makes offline: nothing is downloaded). Inputs have LIBERO's shapes (env.wrist_camera:
two 224 px cameras, 8-D state, 7-D actions; the processor resizes to the vision tower's size), random pixels and
states, one instruction. Columns:

  act ms (E)      `policy.act` on E envs' observations (what env_step / policy_infer nodes call: the prefix KV cache
                  once, K denoising steps of Flow-SDE, the first C actions of the chunk), median of --repeats timed
                  calls after one warm-up, for each E in --envs.
  update s        one PPO step through the graph's own task functions, without a simulator or a scheduler:
                  `tasks.actor.entries.advantages` (GAE with the values the acts returned, random sparse rewards) on a
                  rollout of --chunk-steps acts of --update-envs envs, then `tasks.actor.entries.actor_update` (THE
                  update loop: log-probs recomputed from the stored denoising chain, clipped PPO + value loss, Adam)
                  with update_epochs=1 and minibatches of --micro-batch samples: its `time/update`; `node s` adds
                  what the node hands the replicas (`Actor.sync_weights`: the trainable tensors under LoRA, the full
                  state dict copied to CPU memory with full fine-tuning).
  ratio           train/ratio_mean of that update (1 at its first minibatch: the log-probs are recomputed exactly).
  peak GiB        torch.cuda.max_memory_allocated over the row (reset before it): weights, gradients, Adam,
                  activations of one micro-batch; `plan GiB` beside it is tasks.policies.pi0.memory's offline
                  estimate for the same config (what pipelines.validate checks against cluster.gpu_memory_gib).

A row that fails (out of memory) is printed with its error and the rest go on; the exit code is then 1.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from pathlib import Path

REQUIRED = ("torch", "transformers", "peft", "dask", "distributed", "numpy")
OBS_DIM, ACTION_DIM = 8, 7  # LIBERO's proprio state and OSC_POSE actions
# the tiny byte-level tokenizer spends a token per character: a 25-character instruction is about as long as a
# LIBERO instruction through PaliGemma's tokenizer (~20 tokens), within pi0's max_prompt_len of 48
INSTRUCTION = "put the bowl on the plate"
GIB = 2 ** 30


def preflight(device: str) -> str | None:
    """Why this machine cannot run the benchmark (one line), or None. CUDA first (torch alone is imported)."""
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if "torch" not in missing:
        import torch
        if device == "cuda" and not torch.cuda.is_available():
            return ("no CUDA device (torch.cuda.is_available() is False): this benchmark times the base presets on a "
                    "GPU; `--device cpu --preset tiny` runs its code paths on the CPU")
    if missing:
        return (f"missing Python packages {missing}: install them, or on the device machine carry wheels in .whl/ "
                f"(benchmarks/gpu_pi0.sh --fetch-wheels here, then gpu_pi0.sh there)")
    import transformers
    if not hasattr(transformers, "PI0ForConditionalGeneration"):
        return (f"transformers {transformers.__version__} has no PI0ForConditionalGeneration: pi0 / pi05 need "
                f"transformers >= 5.25 (carry its wheel: benchmarks/gpu_pi0.sh --fetch-wheels)")
    return None


def make_config(family: str, preset: str, mode: str, args, envs: int):
    """The run's Config for one row, built from the schema's dataclasses (no Hydra composition: the device machine
    need not have Hydra or MLflow): the policy preset's keys (conf/policy/<family>_<preset>.yaml and
    _vla_finetune.yaml), LIBERO's env shapes with the wrist camera, PPO with update_epochs=1 and minibatches of
    --micro-batch samples over chunk_steps x envs samples."""
    from tasks.config import AlgorithmConfig, Config, family_class, replace_keys
    base = preset == "base"
    cuda = args.device == "cuda"
    policy = family_class("policy", family)(
        preset=preset, device=args.device, dtype="bfloat16" if cuda and args.dtype == "bfloat16" else "float32",
        num_action_chunks=5, num_denoise_steps=10 if base else 4, noise_method="flow_sde", noise_level=0.5,
        lora_rank=args.lora_rank if mode == "lora" else 0,
        gradient_checkpointing=mode == "full" and not args.no_checkpointing)
    env = family_class("env", "libero")(env_id="libero_spatial", obs_mode="rgb", wrist_camera=True,
                                        image_size=224 if base else 32, num_envs=envs, num_shards=1)
    n = args.chunk_steps * envs
    if n % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide --chunk-steps x --update-envs = {n}")
    algo = AlgorithmConfig(name="ppo", reward_type="chunk_level", logprob_type="token_level", lr=2e-5,
                           update_epochs=1, num_minibatches=n // args.micro_batch, target_kl=None,
                           max_grad_norm=1.0)
    cfg = replace_keys(Config(env=env, policy=policy, algorithm=algo),
                       {"rollout.chunk_steps": args.chunk_steps, "rollout.chunk_steps_per_node": args.chunk_steps})
    # the run's instruction table (tasks.prompts.instructions, what the update prompts each sample with) holds the
    # one instruction of these inputs: LIBERO's own table would import the simulator, which this benchmark needs not
    from tasks import prompts
    prompts._INSTRUCTIONS[repr(cfg.env)] = (INSTRUCTION,)
    return cfg


def observations(cfg, policy, n: int, gen):
    """n envs' observations on the policy's device: (obs dict, state [n, O] f32, rgb [n, 2, H, H, 3] u8)."""
    import torch

    from tasks.device import to_device
    from tasks.prompts import policy_obs
    H = cfg.env.image_size
    state = torch.rand(n, OBS_DIM, generator=gen) * 2 - 1
    rgb = torch.randint(0, 256, (n, 2, H, H, 3), generator=gen, dtype=torch.uint8)
    obs = policy_obs(policy, state, rgb, INSTRUCTION)
    return to_device(obs, next(policy.parameters()).device), state, rgb


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def act_ms(cfg, policy, n: int, repeats: int, gen) -> float:
    """Median ms of `policy.act` on n envs (after one warm-up call), under the run's autocast."""
    import statistics

    from tasks.device import autocast
    obs, _, _ = observations(cfg, policy, n, gen)
    device = next(policy.parameters()).device
    times = []
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        with autocast(cfg.policy.dtype, device):
            policy.act(obs)
        _sync(device)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rollout(cfg, policy, gen) -> dict:
    """A trajectory of one env shard ([T, B, ...] numpy fields, tasks.trajectory.FIELDS) from T = chunk_steps acts
    on random observations: the policy's actions, log-probs, values and extras (the denoising chain); random sparse
    rewards (10 % of chunks), no episode end, all actions executed."""
    import numpy as np
    import torch

    from tasks import trajectory as tj
    from tasks.device import autocast, to_numpy
    T, B, C = cfg.rollout.chunk_steps, cfg.env.num_envs, cfg.policy.num_action_chunks
    device = next(policy.parameters()).device
    steps = []
    for _ in range(T):
        obs, state, rgb = observations(cfg, policy, B, gen)
        with autocast(cfg.policy.dtype, device):
            out = policy.act(obs)
        steps.append({"obs": state.numpy(), "rgb": rgb.numpy(), "out": out})
    traj = {"obs": np.stack([s["obs"] for s in steps]).astype(np.float32),
            "rgb": np.stack([s["rgb"] for s in steps])}
    for k in ("actions", "logprobs", "values"):
        traj[k] = np.stack([to_numpy(s["out"][k]) for s in steps]).astype(np.float32)
    if traj["values"].ndim == 2:  # [T, B] -> [T, B, V=1]
        traj["values"] = traj["values"][..., None]
    for k in steps[0]["out"]["extras"]:
        traj[tj.EXTRAS_PREFIX + k] = np.stack([to_numpy(s["out"]["extras"][k]) for s in steps])
    reward = (torch.rand(T, B, generator=gen) < 0.1).float().numpy()
    traj["rewards"] = np.zeros((T, B, C), np.float32)
    traj["rewards"][..., -1] = reward
    traj["final_values"] = np.zeros_like(traj["values"])
    traj["bootstrap_values"] = traj["values"][-1].copy()
    for k in ("terminated", "truncated", "success"):
        traj[k] = np.zeros((T, B), bool)
    traj["step_mask"] = np.ones((T, B, C), bool)
    traj["task_id"] = np.zeros((T, B), np.int64)
    for k in ("episode_seed", "trial_id", "episode_id"):
        traj[k] = np.broadcast_to(np.arange(B, dtype=np.int64), (T, B)).copy()
    return traj


def row(family: str, mode: str, args) -> dict:
    """Build the actor for one row, time acts for every --envs batch, run one PPO step; returns the row's figures."""
    import torch

    from tasks import resident
    from tasks.actor import entries
    from tasks.actor.actor import build_actor
    from tasks.device import policy_device
    cfg = make_config(family, args.preset, mode, args, args.update_envs)
    device = policy_device(cfg)
    cuda = device.type == "cuda"
    run = f"gpu-bench-{family}-{mode}"
    out = {"family": family, "mode": mode, "preset": args.preset, "device": str(device),
           "dtype": cfg.policy.dtype, "lora_rank": cfg.policy.lora_rank,
           "gradient_checkpointing": cfg.policy.gradient_checkpointing, "micro_batch": args.micro_batch,
           "update_samples": cfg.batch_size}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    try:
        from tasks.policies.pi0 import memory
        out["plan_gib"] = memory.config_plan(cfg).total / GIB
    except Exception as exc:  # the estimate is a side figure: its absence does not stop the row
        out["plan_error"] = f"{type(exc).__name__}: {exc}"
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):  # random weights created on the GPU (a 3.5 B CPU init would take minutes)
        actor = build_actor(cfg, OBS_DIM, ACTION_DIM, load=True)
    _sync(device)
    out["build_s"] = time.perf_counter() - t0
    pol = actor.policy
    out["params"] = sum(p.numel() for p in pol.parameters())
    out["trainable"] = sum(p.numel() for p in pol.parameters() if p.requires_grad)
    actor.base_key = f"{run}-init"  # as actor_init's: updates hand out partial weights when parameters are frozen
    resident.put(f"{run}/actor", actor)
    try:
        pol.eval()
        out["act_ms"] = {str(n): act_ms(cfg, pol, n, args.repeats, gen) for n in args.envs}
        traj = rollout(cfg, pol, gen)
        pol.train()
        adv = entries.advantages(cfg, traj)
        _sync(device)
        t0 = time.perf_counter()
        upd = entries.actor_update(cfg, run, {"version": 0}, adv)
        _sync(device)
        m = upd["metrics"]
        out.update(update_s=m["time/update"], node_s=time.perf_counter() - t0,
                   ratio_mean=m.get("train/ratio_mean"), approx_kl=m.get("train/approx_kl"),
                   actor_loss=m.get("train/actor_loss"), critic_loss=m.get("train/critic_loss"),
                   sync_mb=sum(v.numel() * v.element_size() for v in upd["state_dict"].values()) / 1e6,
                   partial=bool(upd.get("partial")), rebuilt=m.get("train/actor_rebuilt"))
        if cuda:
            out["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
    finally:
        resident.release(f"{run}/")
        del actor, pol
        if cuda:
            torch.cuda.empty_cache()
    return out


def _count(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def table(rows: list[dict], envs: list[int]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    head = (["family", "mode", "params", "trainable", "build s"] + [f"act ms (E={n})" for n in envs]
            + ["update s", "node s", "ratio", "sync MB", "peak GiB", "plan GiB"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['mode']} | error: {r['error']} |")
            continue
        act = r.get("act_ms", {})
        cells = [r["family"], f"{r['mode']}" + (f" r={r['lora_rank']}" if r["lora_rank"] else "")
                 + (" +ckpt" if r["gradient_checkpointing"] else ""),
                 _count(r["params"]), _count(r["trainable"]), f(r.get("build_s"), ".1f")]
        cells += [f(act.get(str(n)), ".1f") for n in envs]
        cells += [f(r.get("update_s"), ".2f"), f(r.get("node_s"), ".2f"), f(r.get("ratio_mean"), ".6f"),
                  f(r.get("sync_mb"), ".1f"), f(r.get("peak_gib"), ".1f"), f(r.get("plan_gib"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--preset", choices=("base", "tiny"), default="base")
    ap.add_argument("--families", nargs="+", default=["pi0", "pi05"], choices=("pi0", "pi05"))
    ap.add_argument("--modes", nargs="+", default=["lora", "full"], choices=("lora", "full"))
    ap.add_argument("--envs", nargs="+", type=int, default=[8, 32, 64], help="env batches act is timed on")
    ap.add_argument("--update-envs", type=int, default=32, help="envs of the rollout the PPO step trains on")
    ap.add_argument("--chunk-steps", type=int, default=2, help="chunk steps of that rollout")
    ap.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward (= per Adam step)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--no-checkpointing", action="store_true", help="full fine-tuning without checkpointing")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="CUDA autocast dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True, help="directory for one JSON per row and results.json")
    args = ap.parse_args(argv)
    why = preflight(args.device)
    if why is not None:
        print(f"gpu_pi0: {why}", file=sys.stderr)
        return 2
    import torch
    if args.device == "cpu":
        torch.set_num_threads(min(4, torch.get_num_threads()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "") + f", preset {args.preset}",
          flush=True)
    rows, failed = [], False
    t_all = time.perf_counter()
    for family in args.families:
        for mode in args.modes:
            t0 = time.perf_counter()
            try:
                r = row(family, mode, args)
            except Exception as exc:  # e.g. CUDA out of memory: report it, go on with the next row
                traceback.print_exc()
                r = {"family": family, "mode": mode, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                failed = True
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            r["wall_s"] = time.perf_counter() - t0
            rows.append(r)
            (out / f"{family}_{mode}.json").write_text(json.dumps(r, indent=1))
            print(f"[{time.perf_counter() - t_all:6.0f}s] {family} {mode}: "
                  + json.dumps({k: v for k, v in r.items() if k not in ("family", "mode")}), flush=True)
    print(table(rows, args.envs))
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
