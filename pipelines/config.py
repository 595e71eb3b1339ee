"""The one check path: compose the Hydra config for `conf=NAME key=value ...`, type it onto the families' classes,
check it once (`load_config`), for `pipelines.run`, `pipelines.validate`, `pipelines.record` (and `pipelines.eval`,
`pipelines.replay`, which load saved run configs through the same `pipelines.compose.to_config`).

Everything a user can get wrong in a config surfaces here, before any worker starts, as `ConfigError` with one
line naming the key, the value and the fix: overrides Hydra cannot parse (a comma in a value, a dict key with
commas: the error gives the quoting that works: `pipelines.overrides`), unknown keys and wrong types (from the
structured schema; a key the chosen policy / env / cluster family lacks is unknown for it, naming the family:
`pipelines.families`), impossible combinations (`tasks.config.check_config`), an env task the simulator does not
have or that needs downloads, a missing Vulkan driver for ManiSkill (`pipelines.components`), a placement the
devices cannot hold, the command's own checks (`pipelines.command_checks`), and keys that were set but do nothing
(`pipelines.compose.check_given`). The module is `load_config` and the names of those modules, kept importable here.

One call path: `load_config(overrides, command=...)` is what `pipelines.run`, `pipelines.validate` and
`pipelines.record` call; nothing they check at start is checked anywhere else.

Keys that do nothing. A key is SET when it is given on the command line or written in the experiment file
(conf/conf/NAME.yaml; the default experiment's when `conf=` is not given); schema defaults are never "set". A set
key that does nothing for the chosen algorithm, policy, env, placement or command (`tasks.config.inert_keys`:
command- and value-dependent; a family's own through its class's `inert_keys`) is refused:
  * given on the command line: an error (`error: key=value: why; fix`);
  * written in the experiment file and doing nothing for that experiment as written: an error naming the file (the
    shipped experiments are checked by tests/pipelines/test_config.py);
  * written in the experiment file but switched off by a command-line override (e.g. the experiment's
    `rollout.chunk_steps_per_node` with `rollout.inference=disaggregated`): one `note:` line on stderr naming the
    key, the file and why. Hydra cannot delete a structured key from the command line (`~key` fails), so an error
    here would force copying the experiment. Likewise a file's keys of another family than the one the command line
    selects (the experiment's local-cluster keys with `cluster=address`: `pipelines.families.drop_other_family_keys`)
    are dropped with one note each.
"""
from __future__ import annotations

import sys
from typing import Sequence

from omegaconf import DictConfig

from tasks.config import Config

# the modules the one check path is made of; their names stay importable from here
from pipelines.command_checks import (check_command, check_record, command_for, record_output_path,  # noqa: F401
                                      resolve_teacher, teacher_config)
from pipelines.components import (SOURCE_ENV_KEYS, SOURCE_ENV_WHY, check_components, check_model_path,  # noqa: F401
                                  check_sft_memory, check_sft_store, check_source_env, model_source_env)
from pipelines.compose import (COMMAND_LINE, CONF_DIR, GROUP_FILE_DEFAULTS, GROUPS, MISSING,  # noqa: F401
                               REQUIRED_KEYS, SCHEMA_NAME, _file_values, check_given, check_params, check_required,
                               compose, experiment_name, from_command_line, given_keys, group_choices,
                               register_schema, schema_keys, to_config, to_dict, to_yaml, unknown_key_fix)
from pipelines.saved_config import load_saved_config, read_saved_config  # noqa: F401
from pipelines.overrides import QUOTING, as_typed, parse_overrides  # noqa: F401


def load_config(overrides: Sequence[str] = (), *, components: bool = True, command: str = "run",
                require_teacher: bool = True, notes: list[str] | None = None) -> tuple[Config, DictConfig]:
    """Compose, type, validate: THE check path of `pipelines.run`, `pipelines.validate` and `pipelines.record`.

    In order: Hydra's grammar (`parse_overrides`), the schema (`compose`, the experiment's `???` keys:
    `check_required`, `to_config`), combinations
    (`tasks.config.check_config`), then with `components`: registries, env task, Vulkan, model_path, sft.store
    (`check_components`), the placement against the devices (`pipelines.clusters.check_placement`, including the
    placement entries that would do nothing) and the command's checks (`check_command`); last, keys that were set
    but do nothing (`check_given`; `notes` as there). `components=False` is the schema + combinations +
    set-but-inert check only (tests, tools).

    Returns (Config, the resolved DictConfig for saving/logging). Raises ConfigError (or VulkanMissingError).
    """
    dcfg = compose(overrides)
    check_required(overrides)
    from pipelines.families import drop_other_family_keys  # the experiment's keys of a family the command line left
    dcfg = drop_other_family_keys(dcfg, given_keys(overrides), from_command_line, notes)
    cfg = to_config(dcfg, overrides=overrides)
    cuda = 0
    if components:
        cfg = sft_dataset(cfg)  # sft.store a LeRobot dataset: checked, read through its converted store
        check_components(cfg, command)
        from pipelines.clusters.placement import _cuda_device_count
        from pipelines.clusters import check_placement
        cuda = _cuda_device_count()
        check_placement(cfg, cuda, command=command)
        check_command(cfg, command, require_teacher=require_teacher)
    check_given(cfg, overrides, command, cuda, notes)
    from tasks.config.checks.inert import unchecked_notes  # keys set cluster-wide that this config does not read
    for line in unchecked_notes(cfg, command):
        if notes is None:
            print(line, file=sys.stderr)
        else:
            notes.append(line)
    check_params(cfg)
    return cfg, dcfg


def sft_dataset(cfg: Config) -> Config:
    """cfg, or where `sft.store` of an SFT config names a LeRobot dataset directory (meta/info.json) a copy whose
    `sft.store` is the dataset's converted demonstration store (`tasks.demo_datasets.dataset_store`: checked against
    the config first, converted once under `<run_root>/datasets/`, reused after: a run's config.yaml and MLflow
    params name that store, whose `lerobot_dataset` attribute names the dataset). Raises ConfigError (sft.store)
    naming the dataset field and the fix."""
    from tasks.demo_datasets import dataset_store, is_dataset
    if cfg.algorithm.spec.estimator or not cfg.sft.store or not is_dataset(cfg.sft.store):
        return cfg
    from tasks.config import replace_key
    return replace_key(cfg, "sft.store", str(dataset_store(cfg)))


def missing_required(overrides: Sequence[str] = ()) -> dict[str, str]:
    """The keys the experiment (or a group file it chooses) leaves `???` and the command line does not give:
    {key: its fix} (`check_required`'s, in its order); {} when every one is given. `--show` shows such an
    experiment with them marked (`shown_yaml`) instead of refusing it; every other command refuses it.

    Raises:
        ConfigError: an error of the command line itself (an unknown experiment, Hydra's grammar)."""
    from tasks.config import ConfigError
    missing: dict[str, str] = {}
    while True:  # check_required names the first one: given as null, the next one shows
        try:
            check_required([*overrides, *(f"{k}=null" for k in missing)])
            return missing
        except ConfigError as exc:
            if exc.value != MISSING or exc.key in missing:
                raise
            missing[exc.key] = exc.fix


def shown_yaml(cfg: Config, missing: dict[str, str] | None = None) -> str:
    """`to_yaml(cfg)` for `--show`; each key of `missing` (`missing_required`: composed as null) is shown as
    `KEY: ???  # required, not given`, and a first comment line names them."""
    text = to_yaml(cfg)
    if not missing:
        return text
    path: list[str] = []
    out = [f"# not given (the experiment leaves them ???, required before it runs): {', '.join(missing)}"]
    for line in text.splitlines():
        body = line.lstrip(" ")
        path = path[:(len(line) - len(body)) // 2] + [body.split(":", 1)[0]]  # YAML's 2-space nesting
        if ".".join(path) in missing:
            line = f"{line.split(':', 1)[0]}: ???  # required, not given"
        out.append(line)
    return "\n".join(out) + "\n"
