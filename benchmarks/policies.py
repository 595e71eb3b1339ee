"""VLA policy families side by side: parameter counts of the real-size presets (built on the meta device, nothing
allocated or downloaded) and measured CPU latencies of the tiny presets; with `--device cuda`, every preset (the
real-size ones too, randomly initialised on the GPU) is timed there.

    .venv/bin/python benchmarks/policies.py [--batch 8] [--n-eval N] [--repeats 5] [--threads 1]
        [--families token_vla] [--set noise_method=flow_noise ...] [--device cuda [--dtype bfloat16]]

Columns
  params            parameters of the preset (tasks.policies.<family>.PRESETS), obs_dim 9, action_dim 7, 224 px
                    images for the real-size presets / 64 px for tiny (env.image_size's default).
  bf16 weights      params * 2 bytes.
  full FT (Adam)    params * 16 bytes: bf16 weights and gradients + fp32 master weights and two Adam moments
                    (Rajbhandari et al. 2020, ZeRO, Sec. 3.1); activations not included.
  act / update ms   tiny preset only (every preset with --device cuda): median wall time of `act` on a batch and
                    of `evaluate` + backward on --n-eval samples (default: the same batch; the PPO update's
                    per-minibatch work), after one warm-up call; on CUDA each call ends with a synchronize.
                    --dtype bfloat16: under tasks.device.autocast (fp32 weights, bf16 matmuls), as
                    policy.dtype=bfloat16 runs.
  peak RSS          the process's maximum resident set size after the row (cumulative over the rows run before
                    it in this process; includes torch/transformers themselves).
  peak CUDA         --device cuda: torch.cuda.max_memory_allocated during the row (reset before it).
  --set KEY=VALUE   PolicyConfig overrides for every row (e.g. noise_method=flow_noise, num_denoise_steps=10).

Add a family by adding a row to FAMILIES (its module must expose the class with the uniform constructor
`cls(cfg, obs_dim, action_dim, num_values, image_size)`).
"""
from __future__ import annotations

import argparse
import ast
import importlib
import resource
import statistics
import time

import torch

from tasks.config import family_class
from tasks.device import autocast, to_device

OBS_DIM, ACTION_DIM = 9, 7

# family -> (module, class, {preset: PolicyConfig overrides}, image size per preset)
FAMILIES: dict[str, tuple[str, str, dict[str, dict], dict[str, int]]] = {
    "token_vla": ("tasks.policies.token_vla.model", "TokenVLAPolicy",
                  {"tiny": dict(num_action_chunks=4), "openvla_oft": dict(num_action_chunks=8)},
                  {"tiny": 64, "openvla_oft": 224}),
}


def build(family: str, preset: str, device: str = "cpu", overrides: dict | None = None) -> torch.nn.Module:
    module, cls_name, presets, images = FAMILIES[family]
    cls = getattr(importlib.import_module(module), cls_name)
    cfg = family_class("policy", family)(preset=preset, **{**presets[preset], **(overrides or {})})
    with torch.device(device):
        return cls(cfg, OBS_DIM, ACTION_DIM, 1, images[preset])


def _median_ms(fn, repeats: int, device: torch.device) -> float:
    def call():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    call()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timings(policy: torch.nn.Module, image_size: int, batch: int, repeats: int, n_eval: int | None = None,
            device: str = "cpu", dtype: str = "float32") -> tuple[float, float]:
    """(act ms on `batch`, evaluate + backward ms on `n_eval` (default `batch`) samples) on random inputs, on
    `device` (where the policy's parameters are) under `dtype`'s autocast."""
    dev = torch.device(device)

    def obs_of(n: int) -> dict:
        return to_device({"prompt": policy.tokenize(["push the cube to the goal"] * n),
                          "state": torch.randn(n, OBS_DIM),
                          "rgb": torch.randint(0, 256, (n, image_size, image_size, 3), dtype=torch.uint8)}, dev)

    obs = obs_of(batch)
    big = obs if not n_eval or n_eval == batch else obs_of(n_eval)
    with autocast(dtype, dev):
        out = policy.act(big)

    def act():
        with autocast(dtype, dev):
            policy.act(obs)

    def update():
        with autocast(dtype, dev):
            ev = policy.evaluate(big, out["actions"], out["extras"])
        (ev["logprobs"].float().sum() + ev["values"].float().sum()).backward()
        policy.zero_grad(set_to_none=True)

    return _median_ms(act, repeats, dev), _median_ms(update, repeats, dev)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--n-eval", type=int, default=None, help="samples per evaluate+backward (default: --batch)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="PolicyConfig overrides")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: time every preset (real-size ones too) on the GPU")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="autocast dtype")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.dtype == "bfloat16" and args.device != "cuda":
        ap.error("--dtype bfloat16 is the CUDA autocast (policy.dtype=bfloat16 needs policy.device=cuda)")
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    n_eval = args.n_eval or args.batch
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, autocast {args.dtype}")
    print(f"| family | preset | params | bf16 weights | full FT (Adam) | act ms (B={args.batch}) | "
          f"update ms (N={n_eval}) | peak RSS |" + (" peak CUDA |" if cuda else ""))
    print("|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if cuda else ""))
    for family in args.families:
        _, _, presets, images = FAMILIES[family]
        for preset in presets:
            timed = cuda or preset == "tiny"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            policy = build(family, preset, args.device if timed else "meta", overrides)
            n = sum(p.numel() for p in policy.parameters())
            size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
            act_ms = upd_ms = "-"
            if timed:
                a, u = timings(policy, images[preset], args.batch, args.repeats, n_eval, args.device, args.dtype)
                act_ms, upd_ms = f"{a:.1f}", f"{u:.1f}"
            row = (f"| {family} | {preset} | {size} | {n * 2 / 2**30:.2f} GiB | {n * 16 / 2**30:.1f} GiB | "
                   f"{act_ms} | {upd_ms} | {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB |")
            if cuda:
                row += f" {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB |"
            print(row, flush=True)
            del policy
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
