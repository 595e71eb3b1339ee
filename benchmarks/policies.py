"""VLA policy families side by side: parameter counts of the real-size presets (built on the meta device, nothing
allocated or downloaded) and measured CPU latencies of the tiny presets.

    .venv/bin/python benchmarks/policies.py [--batch 8] [--n-eval N] [--repeats 5] [--threads 1]
        [--families flow_vla token_vla] [--set noise_method=flow_noise ...]

Columns
  params            parameters of the preset (tasks.policies.<family>.PRESETS), obs_dim 9, action_dim 7, 224 px
                    images for the real-size presets / 64 px for tiny (env.image_size's default).
  bf16 weights      params * 2 bytes.
  full FT (Adam)    params * 16 bytes: bf16 weights and gradients + fp32 master weights and two Adam moments
                    (Rajbhandari et al. 2020, ZeRO, Sec. 3.1); activations not included.
  act / update ms   tiny preset only: median wall time of `act` on a batch and of `evaluate` + backward on
                    --n-eval samples (default: the same batch; the PPO update's per-minibatch work), after one
                    warm-up call.
  peak RSS          the process's maximum resident set size after the row (cumulative over the rows run before
                    it in this process; includes torch/transformers themselves).
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

from tasks.config import PolicyConfig

OBS_DIM, ACTION_DIM = 9, 7

# family -> (module, class, {preset: PolicyConfig overrides}, image size per preset)
FAMILIES: dict[str, tuple[str, str, dict[str, dict], dict[str, int]]] = {
    "flow_vla": ("tasks.policies.flow_vla", "FlowVLAPolicy",
                 {"tiny": dict(num_action_chunks=4, num_denoise_steps=4),
                  "pi0": dict(num_action_chunks=50, num_denoise_steps=10)},
                 {"tiny": 64, "pi0": 224}),
    "token_vla": ("tasks.policies.token_vla", "TokenVLAPolicy",
                  {"tiny": dict(num_action_chunks=4), "openvla_oft": dict(num_action_chunks=8)},
                  {"tiny": 64, "openvla_oft": 224}),
}


def build(family: str, preset: str, device: str = "cpu", overrides: dict | None = None) -> torch.nn.Module:
    module, cls_name, presets, images = FAMILIES[family]
    cls = getattr(importlib.import_module(module), cls_name)
    cfg = PolicyConfig(name=family, preset=preset, **{**presets[preset], **(overrides or {})})
    with torch.device(device):
        return cls(cfg, OBS_DIM, ACTION_DIM, 1, images[preset])


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def timings(policy: torch.nn.Module, image_size: int, batch: int, repeats: int,
            n_eval: int | None = None) -> tuple[float, float]:
    """(act ms on `batch`, evaluate + backward ms on `n_eval` (default `batch`) samples) on random inputs."""
    def obs_of(n: int) -> dict:
        return {"prompt": policy.tokenize(["push the cube to the goal"] * n), "state": torch.randn(n, OBS_DIM),
                "rgb": torch.randint(0, 256, (n, image_size, image_size, 3), dtype=torch.uint8)}

    obs = obs_of(batch)
    big = obs if not n_eval or n_eval == batch else obs_of(n_eval)
    out = policy.act(big)

    def update():
        ev = policy.evaluate(big, out["actions"], out["extras"])
        (ev["logprobs"].sum() + ev["values"].sum()).backward()
        policy.zero_grad(set_to_none=True)

    return _median_ms(lambda: policy.act(obs), repeats), _median_ms(update, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--n-eval", type=int, default=None, help="samples per evaluate+backward (default: --batch)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="PolicyConfig overrides")
    args = ap.parse_args(argv)
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
    print(f"| family | preset | params | bf16 weights | full FT (Adam) | act ms (B={args.batch}) | "
          f"update ms (N={n_eval}) | peak RSS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for family in args.families:
        _, _, presets, images = FAMILIES[family]
        for preset in presets:
            real = preset != "tiny"
            policy = build(family, preset, "meta" if real else "cpu", overrides)
            n = sum(p.numel() for p in policy.parameters())
            size = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
            act_ms = upd_ms = "-"
            if not real:
                a, u = timings(policy, images[preset], args.batch, args.repeats, n_eval)
                act_ms, upd_ms = f"{a:.1f}", f"{u:.1f}"
            print(f"| {family} | {preset} | {size} | {n * 2 / 2**30:.2f} GiB | {n * 16 / 2**30:.1f} GiB | "
                  f"{act_ms} | {upd_ms} | {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB |",
                  flush=True)


if __name__ == "__main__":
    main()
