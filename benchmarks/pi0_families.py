"""Figures of the pi0 / pi05 policy families (transformers' PI0 / PI05 classes), printed:

1. the offline memory plan of the `base` presets per actor GPU (tasks.policies.pi0.memory: an estimate from the
   configs, not a GPU measurement): full fine-tuning vs LoRA r=16, with and without gradient checkpointing, bf16,
   micro-batch 8 (num_minibatches=200 over the 1600-sample batch of 320 envs x 5 chunk steps), K=10, C=5;
2. bytes per weight sync: the full state dict against the trainable tensors a LoRA policy ships
   (tasks.policies.pi0.lora.trainable_names), tiny (real modules) and base (built on the meta device);
3. CPU latency of act and evaluate+backward of pi0_tiny and pi05_tiny (the retired flow_vla family's column is
   history on the results page) at the PushCube VLA recipe's sizes (35-D state, 8-D actions, C=5, K=4, 32 px), one
   thread, best of 5 interleaved repeats.

    python benchmarks/pi0_families.py [--skip-latency]
"""
from __future__ import annotations

import argparse
import time

import torch

GIB = 2 ** 30


def memory_table() -> None:
    from tasks.config.registry import family_class
    from tasks.config.schema import AlgorithmConfig, Config
    from tasks.policies.pi0 import memory
    print("memory plan per actor GPU (base presets, bf16, micro-batch 8, K=10, C=5, 1 GPU of 80 GiB)")
    for fam in ("pi0", "pi05"):
        for rank in (0, 16):
            for ckpt in (False, True):
                cfg = Config(policy=family_class("policy", fam)(preset="base", dtype="bfloat16", num_denoise_steps=10,
                                                                num_action_chunks=5, lora_rank=rank,
                                                                gradient_checkpointing=ckpt),
                             algorithm=AlgorithmConfig(num_minibatches=200),
                             cluster=family_class("cluster", "local")(gpu_memory_gib=80))
                plan = memory.config_plan(cfg)
                verdict = "fits" if plan.total <= 80 * GIB else "refused"
                print(f"  {fam:4s} lora_rank={rank:2d} gradient_checkpointing={ckpt!s:5s} {plan.total / GIB:6.1f} GiB "
                      f"{verdict}")


def sync_table() -> None:
    from tasks.policies.pi0 import library, lora
    from tasks.policies.pi0.configuration import PI0PolicyConfig
    targets = PI0PolicyConfig().lora_targets

    def nbytes(sd):
        return sum(v.numel() * v.element_size() for v in sd.values())

    print("bytes per weight sync (float32 state dicts; a 2-layer value head stands in for the RL heads)")
    for fam in ("pi0", "pi05"):
        for preset in ("tiny", "base"):
            conf = library.preset_config(fam, preset, chunk_size=4 if preset == "tiny" else 50, num_steps=4)
            for rank in (0, 16):
                with torch.device("meta" if preset == "base" else "cpu"):
                    model = library.model_class(fam)(conf)
                    pol = torch.nn.Module()
                    pol.base = model
                    width = conf.vlm_config.text_config.hidden_size
                    pol.value_head = torch.nn.Sequential(torch.nn.Linear(width, 256), torch.nn.Linear(256, 1))
                if rank:
                    lora.apply_lora(model, rank=rank, alpha=2 * rank, targets=targets)
                lora.set_trainable(pol, model, lora=bool(rank), freeze=[])
                sd = pol.state_dict()
                names = set(lora.trainable_names(pol))
                full, sync = nbytes(sd), nbytes({k: v for k, v in sd.items() if k in names})
                print(f"  {fam:4s} {preset:4s} lora_rank={rank:2d}: full {full / 1e6:10.2f} MB, trainable "
                      f"{sync / 1e6:10.3f} MB")


def latency_table() -> None:
    from tasks.config.registry import family_class
    from tasks.policies import make_policy
    torch.set_num_threads(1)
    O, D, C, K = 35, 8, 5, 4

    def build(name):
        return make_policy(family_class("policy", name)(num_action_chunks=C, num_denoise_steps=K,
                                                        noise_method="flow_sde"),
                           obs_dim=O, action_dim=D, seed=0, image_size=32)

    pols = {n: build(n) for n in ("pi0", "pi05")}  # the retired flow_vla column: benchmarks/results/pi0_families.md
    print("CPU latency, 1 thread, best of 5 (ms)")
    for B in (16, 128):
        best = {n: [float("inf"), float("inf")] for n in pols}
        for _ in range(5):
            for n, p in pols.items():
                o = {"state": torch.randn(B, O), "rgb": torch.randint(0, 256, (B, 32, 32, 3), dtype=torch.uint8),
                     "prompt": p.tokenize(["Push the cube to the red and white target."] * B)}
                t = time.perf_counter()
                out = p.act(o)
                best[n][0] = min(best[n][0], time.perf_counter() - t)
                t = time.perf_counter()
                p.evaluate(o, out["actions"], out["extras"])["logprobs"].mean().backward()
                best[n][1] = min(best[n][1], time.perf_counter() - t)
                p.zero_grad()
        for n, (a, u) in best.items():
            print(f"  B={B:3d} {n:8s} act {a * 1e3:7.1f}  evaluate+backward {u * 1e3:7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-latency", action="store_true", help="print the plan and the sync bytes only")
    args = ap.parse_args()
    memory_table()
    sync_table()
    if not args.skip_latency:
        latency_table()


if __name__ == "__main__":
    main()
