"""Structured configs: the one vocabulary shared by conf/ (Hydra YAML), pipelines/ and tasks/.

* `schema` - the section dataclasses (data only) and `Config`; a section with families (policy, env, cluster) has a
  base class with the keys every family has, and each family's class (in its folder) adds its own keys.
* `registry` - the families by name (`register_family`, `family_class`, `families`, `SELECTORS`).
* `checks` - every rule, as functions of the schema (`check_config` runs them all once; the rules registered with
  a family are run from there); `checks.inert` - keys set but doing nothing for a command.
* `estimator_spec(name)` - what `algorithm.name` needs (`tasks.algorithms.specs.EstimatorSpec`: estimator,
  rollout, critic, groups, ...; the specs live beside the estimators' math, the one module of tasks outside this
  package that it imports).
* `edit` - `replace_key(cfg, "algorithm.lr", 1e-3)` / `replace_keys(cfg, {...})`: a changed copy of a built config
  (the sections are frozen; a built config is never changed in place).
* `errors` - `ConfigError` (one line: key, value, fix) and the one did-you-mean; `batch` - the actor's batch plan.

`pipelines.compose.load_config` composes (Hydra), picks each section's family class from the composed selector
and runs every check once; run, validate, eval, record and replay all load through it.
"""
from tasks.config.batch import BatchPlan, batch_plan, check_batch_sizes  # noqa: F401
from tasks.config.checks import (COMMANDS, check_config, check_whole_episodes, config_value,  # noqa: F401
                                 cuda_available, inert_keys, inert_reason)
from tasks.config.edit import replace_key, replace_keys  # noqa: F401
from tasks.config.errors import ConfigError, close_matches, did_you_mean  # noqa: F401
from tasks.config.registry import (SELECTORS, default_class, families, family_checks, family_class,  # noqa: F401
                                   register_family, retired_option)
from tasks.config.schema import (ACTOR_LOSSES, DEVICES, DTYPES, SEED_LIMIT, AlgorithmConfig,  # noqa: F401
                                 ClusterConfig, Config, EnvConfig, EvalConfig, PolicyConfig, RecordConfig,
                                 RolloutConfig, RunnerConfig, SecurityConfig, SFTConfig, StorageConfig,
                                 TrackingConfig, estimator_spec)
