"""`python -m pipelines.eval SOURCE [key=value ...] [--out DIR] [--json]`: evaluate a policy on the fixed eval episodes.

The same evaluation as a training run's (`pipelines.graphs.build_eval`, one `eval_s<i>` node per env shard on its
env worker, `tasks.rollout.evaluate`: deterministic actions, episode i with reset seed `env.eval.seed + i`), on a
checkpoint, outside any training run: its success rates with Wilson 95 % intervals (per `task_id` too when the
env reports one), the per-episode outcomes, the first `runner.eval_videos` episodes filmed, all written to an
output directory and logged to MLflow (experiment `<experiment>-eval`, tag `dagrl.eval_of`). The same weights on
the same episodes give the same outcomes as the training run's own eval of that checkpoint (tested).

SOURCE (the weights, and where the config comes from):
  RUN                          a run directory (runs/<experiment>/<run_id>) or a run id under `run_root`: its best
                               checkpoint (`checkpoints/best`, marked by its evals, or by its validation split's
                               with env.eval.val_episodes > 0), else its newest
  RUN/checkpoints/global_step_N   that checkpoint (also `.../best`, or either's `hf/`); its averaged weights
                               (`policy_ema`) when the run kept them (algorithm.ema_decay > 0): what its evals played
      -> the config is the run's config.yaml; overrides may change only the evaluation and where it runs:
         env.eval.* (num_episodes, num_envs, seed, ...), env.task_ids / env.num_trials (a LIBERO subset: the
         prompts are the suite's whatever the subset), env.robot_visual_lod (the same episodes' dynamics, the
         arm rendered from decimated meshes: tasks.envs.maniskill.mesh_lod), env.fast_step (the same values),
         runner.eval_videos, runner.eval_video_size,
         runner.progress, cluster.*, tracking.*, run_root (another key: exit 2, it would evaluate another policy
         or env than the run's)
  HF_DIR                       a `save_pretrained` directory elsewhere (config.json + model.safetensors): needs
                               `conf=NAME` (the env and eval) among the overrides; it becomes policy.model_path

LIBERO (env.simulator=libero): the evaluation protocol. Unless env.eval.num_episodes is given, it is every
selected task (env.task_ids, default all of the suite's) x every init state of its eval split (env.num_trials: the
first N of them), each (task, trial) pair once (eval seed env.eval.seed + u visits task task_ids[u % T], trial
(u // T) of its eval split: tasks.envs.libero.reset_states). Per task: success with its Wilson 95 % interval and episode count,
keyed by the suite's task id with its name; every episode lists its task_id and trial_id. env.eval.num_envs that is
a multiple of T keeps each eval env on one task (else envs rebuild their instance between tasks: a warning).
Example (pi0 tiny's hf dir, 2 tasks x 2 init states):
  python -m pipelines.eval /path/to/hf conf=libero_smoke env.task_ids=[0,1] env.num_trials=2 env.eval.num_envs=2

Progress: a bar (runner.progress) advances by each eval shard's episodes as its node finishes (env.num_shards eval
nodes: more shards, finer steps).

Output: `--out DIR` (refused if it exists), default `<run dir>/external_evals/<checkpoint>-seed<S>-n<N>` (for an
HF_DIR `<run_root>/external_evals/<dir name>-seed<S>-n<N>`; `-2`, `-3`, ... when taken): `eval.json` = {source,
checkpoint, step, env_id, eval_seed, eval_layout (tasks.evalstats.eval_layout), summary (rates, intervals,
num_episodes), per_task, task_names (LIBERO: task id -> name), episodes (seed -> success_once, success_at_end,
return, episode_len, task_id, trial_id)} and
`videos/`. Printed: one line per task (with several, or named) and the mean; `--json` prints eval.json's summary
part instead.

Exit codes: 0 done, 2 bad input (one line `error: ...`: unknown source, a key the run's policy forbids, a bad
config, an output that exists), 1 a failure during the eval (a lost worker), 130 interrupted.

Examples:
  python -m pipelines.eval runs/pushcube_pi0_sft/20261201-161958-2c8f env.eval.num_episodes=200
  python -m pipelines.eval runs/pushcube_ppo/RUN/checkpoints/global_step_150 runner.eval_videos=4
  python -m pipelines.eval 20261201-161958-2c8f --json                     # a run id under run_root
  python -m pipelines.eval /path/to/hf conf=pushcube_pi0_grpo env.eval.num_episodes=48
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# keys a run source's evaluation may override (prefixes end with "."): the rest is the run's policy and env
EVAL_KEYS = ("env.eval.", "env.task_ids", "env.num_trials", "env.robot_visual_lod", "env.fast_step",
             "runner.eval_videos", "runner.eval_video_size", "runner.progress", "cluster.", "tracking.", "run_root")
EXTERNAL_DIR = "external_evals"


@dataclass
class Source:
    """What to evaluate: a run's checkpoint (`run_dir`, `checkpoint`, `step`) or a standalone hf dir (`hf`)."""

    arg: str
    run_dir: Path | None = None
    checkpoint: Path | None = None
    step: int | None = None
    hf: Path | None = None


def resolve_source(arg: str, run_root: str) -> Source:
    """The checkpoint or hf dir SOURCE names (module docstring).

    Raises:
        tasks.config.ConfigError (key "source"): nothing usable there, with the fix."""
    from storage.checkpoints import best_checkpoint, checkpoint_step, latest_checkpoint, list_checkpoints
    from storage.rundir import find_run_dir
    from tasks.config import ConfigError
    p = Path(arg)
    if not p.exists():
        try:
            p = find_run_dir(run_root, arg)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError("source", arg, f"no such directory, and no run id under run_root={run_root} ({exc}); "
                                             f"give a run dir, a checkpoint dir or an hf dir") from None
    p = p.resolve()
    if (p / "config.yaml").is_file():  # a run directory
        ckpt = best_checkpoint(p) or latest_checkpoint(p)
        if ckpt is None:
            raise ConfigError("source", arg, f"{p} has no complete checkpoint yet")
        ckpt = Path(ckpt).resolve()
        _check_intact(arg, ckpt)
        return Source(arg, run_dir=p, checkpoint=ckpt, step=checkpoint_step(ckpt))
    ckpt = p.parent if p.name == "hf" else p
    if ckpt.parent.name == "checkpoints" and (ckpt.parent.parent / "config.yaml").is_file():  # a run's checkpoint
        run_dir = ckpt.parent.parent
        if ckpt not in [c.resolve() for c in list_checkpoints(run_dir)]:
            raise ConfigError("source", arg, f"{ckpt} is not a complete checkpoint (checkpoints/global_step_N)")
        _check_intact(arg, ckpt)
        return Source(arg, run_dir=run_dir, checkpoint=ckpt, step=checkpoint_step(ckpt))
    if (p / "config.json").is_file():
        return Source(arg, hf=p)
    raise ConfigError("source", arg, f"{p} is neither a run dir (config.yaml), a run's checkpoint "
                                     f"(checkpoints/global_step_N) nor an hf dir (config.json)")


def _check_intact(arg: str, ckpt: Path) -> None:
    """The policy's files of `ckpt` match its index (sha256), checked before anything starts.

    Raises:
        tasks.config.ConfigError (key "source"): a file is missing or damaged, named, with the fix."""
    from storage.checkpoints import checkpoint_damage, played_policy_key
    from tasks.config import ConfigError
    why = checkpoint_damage(ckpt, keys=(played_policy_key(ckpt),))
    if why:
        raise ConfigError("source", arg, f"{why}; evaluate another checkpoint of the run (checkpoints/global_step_N)")


def eval_config(src: Source, overrides: list[str]):
    """The Config of the evaluation: the run's config.yaml with the evaluation's overrides (EVAL_KEYS only), or for
    an hf dir the composed `conf=NAME` config with policy.model_path=that dir. Checked like a run's
    (`pipelines.config`: schema, combinations, components).

    Raises:
        tasks.config.ConfigError: a key outside EVAL_KEYS for a run source, no conf= for an hf dir, a bad value."""
    from omegaconf import OmegaConf

    from pipelines.config import as_typed, check_components, load_config, parse_overrides, to_config
    from tasks.config import ConfigError
    if src.hf is not None:
        if not any(o.split("=", 1)[0] == "conf" for o in overrides):
            raise ConfigError("conf", None, f"{src.hf} is an hf dir outside a run: name the experiment it is "
                                            f"evaluated in (env, eval), e.g. conf=pushcube_pi0_grpo")
        return protocol_defaults(load_config([*overrides, f"policy.model_path={src.hf}"])[0], overrides)
    parse_overrides(overrides)  # Hydra's grammar: one line for a malformed word
    allowed = ", ".join(k + "*" if k.endswith(".") else k for k in EVAL_KEYS)
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in EVAL_KEYS):
            raise ConfigError(key, o.split("=", 1)[1] if "=" in o else None,
                              f"the policy and env of {src.run_dir} come from its config.yaml; an eval of its "
                              f"checkpoint may set only {allowed}")
    from pipelines.config import read_saved_config
    saved = read_saved_config(src.run_dir / "config.yaml")  # verified: a cut file would read as defaults
    if OmegaConf.select(saved, "env.eval.val_episodes"):  # the run's validation split: an eval plays the eval's
        saved.env.eval.val_episodes = 0  # episodes only, on whatever seeds an override gives (val's included)
    try:
        # string keys keep the text typed (run_root=2026_12 is "2026_12", not 202612: pipelines.config.as_typed)
        merged = OmegaConf.merge(saved, OmegaConf.from_dotlist([o.lstrip("+") for o in as_typed(overrides)]))
    except Exception as exc:  # noqa: BLE001 - OmegaConf's type errors: one line
        raise ConfigError("overrides", " ".join(overrides), str(exc).splitlines()[0]) from None
    cfg = protocol_defaults(to_config(merged, saved=True), overrides)
    check_components(cfg)
    return cfg


def protocol_defaults(cfg, overrides: list[str]):
    """LIBERO's evaluation protocol (module docstring): env.eval.num_episodes = every selected (task, eval init
    state) pair unless an override sets it; other simulators unchanged. Returns cfg, or a copy of it with that key
    (the config is frozen: tasks.config.replace_key)."""
    from tasks.config import replace_key
    from tasks.envs import protocol_episodes
    if not any(o.lstrip("+").split("=", 1)[0] == "env.eval.num_episodes" for o in overrides):
        n = protocol_episodes(cfg.env)  # None: the simulator has no protocol of its own
        if n is not None:
            cfg = replace_key(cfg, "env.eval.num_episodes", n)
    return cfg


def output_dir(src: Source, cfg, out: str | None) -> Path:
    """`--out`, refused if it exists; else the default of the module docstring, made unique."""
    from tasks.config import ConfigError
    if out is not None:
        if Path(out).exists():
            raise ConfigError("--out", out, "exists; choose another directory (an eval is never overwritten)")
        return Path(out)
    ev = cfg.env.eval
    if src.run_dir is not None:
        base = src.run_dir / EXTERNAL_DIR / f"{src.checkpoint.name}-seed{ev.seed}-n{ev.num_episodes}"
    else:
        base = Path(cfg.run_root) / EXTERNAL_DIR / f"{src.hf.name}-seed{ev.seed}-n{ev.num_episodes}"
    d, k = base, 1
    while d.exists():
        k += 1
        d = base.with_name(f"{base.name}-{k}")
    return d


def per_task(episodes: list[dict]) -> dict[str, dict]:
    """{task_id: rate_summary} over the episodes that carry a `task_id` (every env shard's episodes do; ManiSkill's
    are task 0), in task-id order; {} when none does."""
    from tasks.evalstats import episode_outcomes, rate_summary
    tasks: dict[int, list[dict]] = {}
    for e in episodes:
        if e.get("task_id") is not None:
            tasks.setdefault(int(e["task_id"]), []).append(e)
    return {str(t): rate_summary(episode_outcomes(tasks[t])) for t in sorted(tasks)}


def task_names(cfg) -> dict[str, str]:
    """{task_id: name} of the selected tasks (LIBERO: the suite's task names); {} for other simulators
    (`tasks.envs.eval_task_names`)."""
    from tasks.envs import eval_task_names
    return eval_task_names(cfg.env)


def shard_episode_counts(cfg) -> list[int]:
    """Eval episodes each eval shard plays (episode i on eval env i % N; shard s holds envs s*N/S ...)."""
    ev, S = cfg.env.eval, cfg.env.num_shards
    per = ev.num_envs // S
    counts = [0] * S
    for i in range(ev.num_episodes):
        counts[(i % ev.num_envs) // per] += 1
    return counts


def evaluate(cfg, src: Source, out: Path, handle, *, echo=print) -> dict:
    """Run the eval graph on the cluster of `handle`; write `out/eval.json` (+ videos); returns its record."""
    from pipelines import graphs
    from pipelines.clusters import plan_placement
    from pipelines.runner.watcher import Watcher
    from storage.checkpoints import load_checkpoint, played_policy_key
    from tqdm import tqdm

    from tasks import evalstats
    from tasks.rollout import env_dims

    ev = cfg.env.eval
    client = handle.client
    placement = plan_placement(cfg, client)
    watch = Watcher(cfg, client, placement)
    t0 = time.perf_counter()
    if src.checkpoint is not None:
        key = played_policy_key(src.checkpoint)  # the average when the run kept one: what its evals played
        state_dict = load_checkpoint(src.checkpoint, keys=(key,))[key]
        version = f"eval:{src.checkpoint}"
    else:
        from tasks.policies import make_policy
        from tasks.rollout import image_size, num_values  # noqa: F401
        obs_dim, action_dim = watch.results([client.submit(env_dims, cfg, workers=[placement.shard_workers[0]],
                                                           pure=False)], "the env_dims task")[0]
        state_dict = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=num_values(cfg),
                                 image_size=image_size(cfg), load=True).state_dict()
        version = f"eval:{src.hf}"
    # the weights live on the actor's worker (as a training run's); the eval nodes pull them from there
    weights = client.scatter({"version": version, "state_dict": state_dict}, workers=[placement.actor_worker])
    eval_id = f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
    video_dir = out / "videos" if graphs.eval_video_count(cfg) else None
    try:  # claimed here: two evaluations of one checkpoint at once chose the same free name (output_dir)
        out.mkdir(parents=True)
    except FileExistsError:
        from tasks.config import ConfigError
        raise ConfigError("output", str(out), "was created meanwhile by another command (another evaluation of "
                                              "the same checkpoint?); run again: the default takes the next free "
                                              "name, or give --out") from None
    if video_dir is not None:
        video_dir.mkdir()  # the eval_videos node writes into it and never makes it (tasks.video.eval_videos)
    graph, keys = graphs.build_eval(cfg, run_id=eval_id, step=src.step or 0, weights=weights, placement=placement,
                                    video_dir=None if video_dir is None else str(video_dir))
    futures = client.get(graph, keys, sync=False)
    bar = tqdm(total=ev.num_episodes, desc="eval", unit="episode", dynamic_ncols=True, file=sys.stderr,
               disable=not cfg.runner.progress)
    for fut, n in zip(futures, shard_episode_counts(cfg)):  # a shard's episodes when its node finishes
        fut.add_done_callback(lambda f, n=n: bar.update(n) if f.status == "finished" else None)
    try:
        parts = watch.results(futures, "the evaluation")
    finally:
        bar.close()
        from tasks import resident
        resident.release_on(client, f"{eval_id}/")  # its eval envs: a shared cluster (cluster.address) keeps them
    videos = parts.pop() if video_dir is not None else None
    episodes = [e for part in parts for e in part]
    _, outcomes = evalstats.split_metrics(episodes)  # scored as a training run's eval scores them
    evalstats.check_fixed_episodes(outcomes, ev.seed, ev.num_episodes, what="the evaluation", key="env.eval.seed")
    for e in episodes:  # which task and init state each episode was
        outcomes[str(int(e["seed"]))].update(task_id=int(e.get("task_id", 0)), trial_id=int(e.get("trial_id", -1)))
    names = task_names(cfg)
    tasks_summary = per_task(episodes)
    if len(tasks_summary) == 1 and not names:  # one unnamed task (ManiSkill): the summary says it all
        tasks_summary = {}
    rec = {"source": src.arg, "run_dir": None if src.run_dir is None else str(src.run_dir),
           "checkpoint": str(src.checkpoint or src.hf), "step": src.step, "env_id": cfg.env.env_id,
           "eval_seed": ev.seed, "eval_layout": evalstats.eval_layout(cfg), "seconds": time.perf_counter() - t0,
           "summary": evalstats.rate_summary(outcomes),
           "per_task": tasks_summary, "task_names": names, "episodes": outcomes,
           "videos": [] if videos is None else [v.get("path") for v in videos.get("videos", [])],
           "video_error": None if videos is None else videos.get("error")}
    from storage.rundir import write_text_atomic
    write_text_atomic(out / "eval.json", json.dumps(rec, indent=1))
    return rec


def log_to_mlflow(cfg, rec: dict, out: Path) -> str:
    """One MLflow run in experiment `<experiment>-eval` (tag `dagrl.eval_of` = the checkpoint): params (the
    source, env id, eval keys), metrics `eval/*` at the checkpoint's step, `eval.json` and the videos as artifacts.
    Returns the MLflow run id."""
    from pipelines.runner.setup import tracking_uri
    from storage.tracking import Tracker
    from tasks.envs import eval_params
    tr = Tracker(uri=tracking_uri(cfg), experiment=f"{cfg.tracking.experiment or cfg.experiment}-eval",
                 run_name=out.name)
    tr.client.set_tag(tr.run_id, "dagrl.eval_of", rec["checkpoint"])
    ev = cfg.env.eval
    tr.log_params({"source": rec["source"], "checkpoint": rec["checkpoint"], "env.env_id": cfg.env.env_id,
                   "env.eval.seed": ev.seed, "env.eval.num_episodes": ev.num_episodes,
                   "env.eval.num_envs": ev.num_envs, **eval_params(cfg.env)})
    m = {f"eval/{k}": float(v) for k, v in rec["summary"].items()}
    for t, s in rec["per_task"].items():
        m.update({f"eval/task_{t}/{k}": float(v) for k, v in s.items()})
    m["time/eval"] = float(rec["seconds"])
    tr.log_metrics(m, step=rec["step"] or 0)
    tr.log_artifact(out)
    tr.set_terminated("FINISHED")
    return tr.run_id


def report_lines(rec: dict) -> list[str]:
    """The printed result: one line per task (when there are several), then the mean, with Wilson intervals."""
    from tasks.evalstats import fmt_rate

    def line(name: str, s: dict) -> str:
        once = fmt_rate(s["success_once"], s["success_once_ci_low"], s["success_once_ci_high"], int(s["num_episodes"]))
        end = fmt_rate(s["success_at_end"], s["success_at_end_ci_low"], s["success_at_end_ci_high"])
        return f"dagrl eval: {name}: success_once {once} (success_at_end {end})"
    names = rec.get("task_names") or {}
    lines = [line(f"task {t}" + (f" ({names[t]})" if t in names else ""), s) for t, s in rec["per_task"].items()] \
        if len(rec["per_task"]) > 1 or names else []
    what = rec["env_id"] + ("" if rec["step"] is None else f" at step {rec['step']}")
    return [*lines, line(f"{what} ({rec['checkpoint']})", rec["summary"])]


def parser():
    """The command's argparse parser (one-line errors: pipelines.cli.ArgumentParser)."""
    import argparse

    from pipelines.cli import ArgumentParser, examples
    p = ArgumentParser(prog="python -m pipelines.eval", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=examples(__doc__), add_help=False)
    p.add_argument("source", help="a run dir or run id, a run's checkpoint dir, or an hf dir")
    p.add_argument("overrides", nargs="*", help="key=value: the eval's keys (module docstring)")
    p.add_argument("--out", default=None, help="output directory (refused if it exists)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def parse_args(argv: list[str]):
    """The parsed words. Raises pipelines.cli.UsageError (one line) for a bad word."""
    from pipelines.cli import UsageError
    args = parser().parse_intermixed_args(argv)
    bad = [w for w in args.overrides if "=" not in w and not w.startswith("~")]
    if bad:
        raise UsageError(f"{bad[0]!r} is not key=value (Hydra override); see python -m pipelines.eval --help")
    return args


def main(argv: list[str] | None = None) -> int:
    """`python -m pipelines.eval ...` (module docstring). Returns the exit code."""
    from pipelines.cli import UsageError, check_interrupted, preflight, start, with_cluster
    from tasks.config import ConfigError
    argv = start(argv, __doc__)
    if argv is None:
        return 0
    try:
        from pipelines.cli import as_overrides  # --run-root DIR: run_root=DIR, the spelling of every command
        args = parse_args(as_overrides(argv, "python -m pipelines.eval"))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run_root = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("run_root=")), "runs")
    try:
        src = resolve_source(args.source, run_root)
        cfg = eval_config(src, args.overrides)
        out = output_dir(src, cfg, args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    check_interrupted()
    if not preflight(cfg, writes=[("--out" if args.out else "output", str(out), out.parent)]):
        return 2

    def body(handle) -> int:
        print(f"dagrl eval: {src.checkpoint or src.hf} on {cfg.env.eval.num_episodes} episodes | dashboard "
              f"{handle.dashboard_link}", flush=True)
        rec = evaluate(cfg, src, out, handle)
        mlflow_id = log_to_mlflow(cfg, rec, out)
        if args.json:
            print(json.dumps({k: rec[k] for k in ("source", "checkpoint", "step", "env_id", "eval_seed", "summary",
                                                  "per_task", "task_names")}, indent=1))
        else:
            for line in report_lines(rec):
                print(line)
            print(f"dagrl eval: {int(rec['summary']['num_episodes'])} episodes in {rec['seconds']:.0f}s -> {out} "
                  f"(MLflow run {mlflow_id})")
        return 0
    return with_cluster(cfg, body)


if __name__ == "__main__":
    from pipelines.cli import entry
    sys.exit(entry(main))
