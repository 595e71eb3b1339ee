"""`python -m pipelines.validate [conf=NAME] [key=value ...] [--show] [--connect]`: every config check, offline.

Runs exactly the checks `pipelines.run` runs before starting workers (`pipelines.config.load_config`: Hydra's
grammar; schema: unknown keys and types; combinations; env task, asset downloads, policy name; Vulkan driver;
placement; keys that are set but do nothing; where it would write: `run_root` (or a recording's output directory)
writable, `tracking.uri` reachable) and prints the derived layout of a training step. A config that sets
`record.*` keys (conf=pushcube_record) gets the checks of `pipelines.record` instead, the teacher's only when
`record.teacher` is given. No cluster is started; `cluster.component_placement` is checked against the devices the config implies
(`cluster.num_gpus`, else the CUDA devices, else `cluster.num_gpu_workers`; for an existing scheduler
(`cluster=address`) without `num_gpus` only its syntax). With `--connect` and `cluster=address cluster.address=...`
set, it also connects to that scheduler and
checks that its workers have the devices and resources the placement needs (nothing is submitted).
With `--connect` it also prints the workers it found (name, address, resources, memory limit, threads, status)
and the components the placement puts on each. `--connect` with the embedded cluster (cluster.kind=local) is an
error.
`--show` prints the resolved config, also of an experiment that leaves required keys `???` (shown marked, then
refused: exit 2). `--help` also lists the experiments and the config groups' options.
Exit codes: 0 valid, 2 invalid, an unknown flag or a word that is not an override (one line on stderr).

Examples:
  python -m pipelines.validate                                   # the default experiment
  python -m pipelines.validate conf=pushcube_ppo env=pickcube --show
  python -m pipelines.validate conf=pushcube_pi0_grpo policy.model_path=SFT_RUN/checkpoints/global_step_30/hf
  python -m pipelines.validate cluster=address cluster.address=tcp://127.0.0.1:8786 --connect
"""
from __future__ import annotations

import sys


def describe(cfg, placement=None) -> str:
    """Human summary of the derived layout of one training step (`placement`: a clusters.ComponentPlacement)."""
    from pipelines.clusters import describe_cluster
    e, r, p, a = cfg.env, cfg.rollout, cfg.policy, cfg.algorithm
    S, T, R = e.num_shards, r.chunk_steps, a.num_actor_ranks
    # once: weights_handle, update_handle, step_metrics + the R actor_update nodes; per shard: trajectory,
    # advantages, store; the rollout: colocated, env_step segments per shard; disaggregated, per stage an
    # env_observe per shard and per chunk step a policy_infer (+1 bootstrap) and an env_step per shard
    if r.inference == "colocated":
        rollout_nodes, per = S * cfg.num_segments, f"{cfg.num_segments} env_step nodes of {r.chunk_steps_per_node} " \
                                                  f"chunk steps per shard"
    else:
        q = r.pipeline_stage_num
        rollout_nodes = q * (S + (T + 1) + T * S)
        per = f"{T} env_step nodes of 1 chunk step per shard and stage, {q * (T + 1)} policy_infer nodes"
    nodes = rollout_nodes + S * (2 + cfg.storage.save_trajectories) + 3 + R
    if not a.spec.rollout:  # SFT: no rollout, its samples come from sft.store
        loaders = min(cfg.sft.num_loaders, cfg.sft.updates_per_step)
        nodes, per = loaders + 2, f"{loaders} sft_load nodes, sft_update, step_metrics; no rollout"
    return "\n".join([
        f"experiment {cfg.experiment}: {e.simulator}:{e.env_id} obs={e.obs_mode} control={e.control_mode}",
        f"  envs {e.num_envs} in {e.num_shards} env shards of {e.shard_size}; eval {e.eval.num_envs} envs, "
        f"{e.eval.num_episodes} episodes every {cfg.runner.val_check_interval} steps",
        f"  rollout T={r.chunk_steps} chunk steps x C={p.num_action_chunks} actions "
        f"= {e.num_envs * r.chunk_steps * p.num_action_chunks} env steps per training step ({r.inference} inference)",
        f"  update: batch {cfg.batch_size} samples, {a.num_minibatches} minibatches of {cfg.minibatch_size}, "
        f"{a.update_epochs} epochs; reward {a.reward_type}, logprob {a.logprob_type}",
        f"  graph: {nodes} nodes per step ({per})",
        f"  cluster: " + describe_cluster(cfg, placement.num_devices if placement else None),
        f"  placement: " + (placement.describe() if placement is not None else
                            "on the cluster's GPU workers (counted once connected)"),
    ])


def describe_workers(info: dict, placement=None, inference: str = "colocated") -> str:
    """The workers of a live cluster, one line each: name, address, resources, memory limit, threads, status and,
    with `placement` (a cluster.Placement planned on them), the components it puts there (the rollout's
    policy_infer nodes only with `inference="disaggregated"`; colocated inference runs in the env shards' nodes).

    Args:
        info: `client.scheduler_info(n_workers=-1)` (its `address` and `workers`).
    """
    from dask.utils import format_bytes
    from pipelines.clusters import natural_order
    workers = info.get("workers", {})
    roles: dict[str, list[str]] = {}
    if placement is not None:
        for r, w in enumerate(placement.actor_workers):
            roles.setdefault(w, []).append(f"actor rank {r}" if len(placement.actor_workers) > 1 else "actor")
        for w in placement.rollout_workers:
            if inference == "disaggregated":
                roles.setdefault(w, []).append("rollout")
        for s, w in enumerate(placement.shard_workers):
            roles.setdefault(w, []).append(f"env shard {s}")
    lines = [f"  workers: {len(workers)} at {info.get('address', '?')}"]
    for addr, w in sorted(workers.items(), key=lambda kv: (natural_order(kv[1].get("name", kv[0])), kv[0])):
        res = ",".join(f"{k}={v:g}" for k, v in sorted((w.get("resources") or {}).items())) or "none"
        mem = format_bytes(w["memory_limit"]) if w.get("memory_limit") else "no limit"
        lines.append(f"    {w.get('name', addr)!s:<10} {addr:<26} resources {res:<10} memory {mem:>10}  "
                     f"{w.get('nthreads', '?')} thread(s)  {w.get('status', '?')}"
                     + (f"  <- {', '.join(roles[addr])}" if addr in roles else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.validate ...` (module docstring). Returns the exit code."""
    from pipelines.cli import overrides_and_flags
    words = overrides_and_flags(argv, __doc__, "python -m pipelines.validate",
                                {"--show": "print the resolved config",
                                 "--connect": "check the workers of cluster.address"})
    if isinstance(words, int):
        return words
    flags, overrides = words
    from pipelines.config import load_config, to_yaml
    from tasks.config import ConfigError
    from tasks.envs.errors import SimulatorUnavailable
    try:
        # the check path of pipelines.run (or of pipelines.record for a config that sets record.* keys)
        from pipelines.config import command_for
        command = command_for(overrides)
        if "--show" in flags:  # an experiment that leaves required keys ???: shown marked, then refused below
            from pipelines.config import missing_required
            if missing_required(overrides):
                from pipelines.cli import show
                show(overrides, command, notes=False)
        cfg, _ = load_config(overrides, command=command, require_teacher=False)
        from pipelines.clusters import check_placement
        placement = check_placement(cfg, command=command)
        from pipelines.cli import preflight  # where the command would write (run_root, tracking.uri, record.out)
        if command == "record":
            from pipelines.record import preflight_writes
            if not preflight(cfg, tracking=False, writes=preflight_writes(cfg)):
                return 2
        elif not preflight(cfg):
            return 2
        resumes = None
        if command == "run" and cfg.runner.resume is not None:  # pipelines.run's offline resume check, too
            from pipelines.runner.setup import resolve_resume
            found = resolve_resume(cfg)
            changed = ", ".join(f"{k}={v}" for k, v in sorted(found.changed.items()))
            resumes = (f"  resume: run {found.state.run_id} from {found.checkpoint} (step {found.state.step}; every "
                       f"file matches its sha256)" + (f"; changed: {changed}" if changed else ""))
        workers = None
        if "--connect" in flags:
            from pipelines.clusters import ComponentPlacement, attach, cluster_info, plan_placement
            with attach(cfg) as client:  # an existing scheduler (cluster.kind=address); else one line, exit 2
                info = cluster_info(client)  # every worker (Client.scheduler_info's cache can miss some)
            live = plan_placement(cfg, info)
            placement = ComponentPlacement(live.devices, len(live.gpu_workers), live.mode)
            workers = describe_workers(info, live, cfg.rollout.inference)
    except (ConfigError, SimulatorUnavailable, ConnectionError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from pipelines.cli import check_interrupted
    check_interrupted()  # a Ctrl-C that a library swallowed during the imports: no "ok"
    if "--show" in flags:
        print(to_yaml(cfg))
    print("ok: " + describe(cfg, placement))
    if resumes is not None:
        print(resumes)
    if workers is not None:
        print(workers)
    if command == "record":
        print("  for: python -m pipelines.record" + ("" if cfg.record.teacher else
                                                     " (record.teacher not set: pipelines.record needs it)"))
    return 0


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
