"""The config's rules as functions of the schema (tasks.config.checks): each section's own, its family's, and those
across sections; the schema's own helpers (EvalConfig.split). No Hydra here: configs are built directly."""
from __future__ import annotations

import pytest

from tasks.config import Config, ConfigError, check_config, replace_key


def test_eval_split_names():
    from tasks.config import EvalConfig
    ev = EvalConfig(num_envs=4, num_episodes=8, seed=10, val_episodes=6, val_seed=100)
    val = ev.split("val")
    assert (val.num_envs, val.num_episodes, val.seed, val.val_episodes, val.ignore_terminations) == (4, 6, 100, 0, True)
    with pytest.raises(ValueError, match="'test'"):
        ev.split("test")
    with pytest.raises(ValueError, match="val_episodes > 0"):
        EvalConfig().split("val")


# ----- validation lives with each section -----

SECTION_CASES = [("env", "num_shards", 0), ("env.eval", "num_episodes", 0), ("env", "image_size", 4),
                 ("policy", "noise_method", "sde"), ("policy", "dtype", "float16"), ("algorithm", "gamma", 0.0),
                 ("algorithm", "nonfinite", "ignore"), ("rollout", "inference", "remote"),
                 ("rollout", "pipeline_stage_num", 2), ("runner", "max_staleness", -1), ("runner", "resume", ""),
                 ("cluster", "num_gpus", 0), ("cluster", "address", "tcp://host")]


def _section_check(path: str):
    """The rules of section `path` alone (tasks.config.checks: the section's function, then its family's rules)."""
    from tasks.config import checks
    return {"env": lambda c: (checks.check_env(c.env), checks.check_family(c, "env")),
            "env.eval": lambda c: checks.check_eval(c.env.eval),
            "policy": lambda c: (checks.check_policy(c.policy), checks.check_family(c, "policy")),
            "algorithm": lambda c: checks.check_algorithm(c.algorithm),
            "rollout": lambda c: checks.check_rollout(c.rollout),
            "runner": lambda c: checks.check_runner(c.runner),
            "cluster": lambda c: checks.check_family(c, "cluster")}[path]


# a key that only some families have: set on a config of that family (section -> selector value)
FAMILY_OF = {("policy", "noise_method"): "pi0", ("cluster", "address"): "address"}


@pytest.mark.parametrize("path, field, value", SECTION_CASES, ids=[f"{p}.{f}" for p, f, _ in SECTION_CASES])
def test_each_section_checks_its_own_fields(path, field, value):
    """A section's own bad value is refused by its rules alone (no other section needed; the section's function in
    tasks.config.checks and its family's rules) and by `check_config`, under the same dotted key."""
    from tasks.config import family_class
    cfg = Config()
    if (path, field) in FAMILY_OF:
        cfg = replace_key(cfg, path, family_class(path, FAMILY_OF[path, field])())
    if (path, field) == ("env", "image_size") or FAMILY_OF.get((path, field)) == "pi0":
        cfg = replace_key(cfg, "env.obs_mode", "rgb")  # image_size is read (and pi0 reads images) with rgb only
    section = cfg
    for part in path.split("."):
        section = getattr(section, part)
    check = _section_check(path)
    if (path, field) != ("cluster", "address"):  # an address kind needs its address
        check(cfg)  # the defaults pass
    assert hasattr(section, field)
    cfg = replace_key(cfg, f"{path}.{field}", value)
    with pytest.raises(ConfigError) as alone:
        check(cfg)
    with pytest.raises(ConfigError) as whole:
        check_config(cfg)
    assert alone.value.key == whole.value.key == f"{path}.{field}"


def test_checks_that_need_several_sections_are_config_check_across():
    from tasks.config.checks import check_across, check_algorithm, check_env
    cfg = replace_key(Config(), "env.num_envs", 5)  # 5 envs in 2 shards: refused for RL (rollout shards), not a property of env alone
    check_env(cfg.env)
    with pytest.raises(ConfigError, match="env.num_envs=5: must be divisible by env.num_shards=2"):
        check_across(cfg)
    cfg = replace_key(cfg, "algorithm.critic_lr", 1e-3)  # the mlp has one learning rate: algorithm against policy
    cfg = replace_key(cfg, "env.num_envs", 4)
    check_algorithm(cfg.algorithm)
    with pytest.raises(ConfigError, match="algorithm.critic_lr"):
        check_config(cfg)


def test_gpu_memory_gib_without_a_memory_plan_is_a_note_not_a_refusal():
    """cluster.gpu_memory_gib is checked against the families that declare a memory plan (pi0, pi05); for the others
    it is said in one note line (a cluster-wide setting is not refused), and not said when unset or not training."""
    from tasks.config import family_class
    from tasks.config.checks.inert import unchecked_notes
    cluster = family_class("cluster", "local")
    mlp = Config(cluster=cluster(gpu_memory_gib=80))
    notes = unchecked_notes(mlp)
    assert len(notes) == 1 and notes[0].startswith("note: cluster.gpu_memory_gib=80")
    assert "policy.name=mlp" in notes[0] and "pi0, pi05" in notes[0] and "\n" not in notes[0]
    assert unchecked_notes(Config()) == [] and unchecked_notes(mlp, "record") == []
    pi0 = Config(policy=family_class("policy", "pi0")(), cluster=cluster(gpu_memory_gib=80))
    assert unchecked_notes(pi0) == []
