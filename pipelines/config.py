"""Compose the Hydra config for `conf=NAME key=value ...`, map it onto `tasks.config.Config`, validate once.

Everything a user can get wrong in a config surfaces here, before any worker starts, as `ConfigError` with one
line naming the key, the value and the fix: overrides Hydra cannot parse (a comma in a value, a dict key with
commas: the error gives the quoting that works), unknown keys and wrong types (from the structured schema),
impossible combinations (`Config.validate`), an env task the simulator does not have or that needs downloads, a
missing Vulkan driver for ManiSkill, a placement the devices cannot hold, the command's own checks
(`check_command`), and keys that were set but do nothing (`check_given`).

One call path: `load_config(overrides, command=...)` is what `pipelines.run`, `pipelines.validate` and
`pipelines.record` call; nothing they check at start is checked anywhere else.

Keys that do nothing. A key is SET when it is given on the command line or written in the experiment file
(conf/conf/NAME.yaml; the default experiment's when `conf=` is not given); schema defaults are never "set". A set
key that does nothing for the chosen algorithm, policy, env, placement or command (`tasks.config.inert_keys`) is
refused:
  * given on the command line: an error (`error: key=value: why; fix`);
  * written in the experiment file and doing nothing for that experiment as written: an error naming the file (the
    shipped experiments are checked by tests/pipelines/test_config.py);
  * written in the experiment file but switched off by a command-line override (e.g. the experiment's
    `rollout.chunk_steps_per_node` with `rollout.inference=disaggregated`, or its local-cluster keys with
    `cluster.address`): one `note:` line on stderr naming the key, the file and why. Hydra cannot delete a
    structured key from the command line (`~key` fails), so an error here would force copying the experiment.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from tasks.config import REMOVED_KEYS, Config, ConfigError, close_matches, did_you_mean, upgrade_saved_config

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SCHEMA_NAME = "dagrl_schema"


def register_schema() -> None:
    """Register `Config` in Hydra's ConfigStore as `dagrl_schema` (the first entry of conf/config.yaml's defaults)."""
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose conf/config.yaml with command-line overrides (`conf=NAME`, `a.b=value`, `+new=...`).

    Raises:
        ConfigError: unknown key, wrong type, unknown `conf` name, or an override Hydra cannot parse (named, with
            the quoting that works: `parse_overrides`).
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    typed = as_typed(overrides)  # Hydra's grammar; strings kept as typed (`as_typed`)
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=typed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _config_error(exc, overrides) from None


# How values with commas, lists and dicts are written on the command line (Hydra's override grammar; tested in
# tests/pipelines/test_config.py). An unquoted comma makes a sweep (several runs), which dagrl refuses.
QUOTING = ("a value with commas is a quoted string: key='\"0,1\"' (the shell passes key=\"0,1\" to Hydra), "
           "a list is [a,b], a dict is {k: v} with commas inside its keys escaped ({actor\\,env: all}), and a "
           "new dict key needs a leading + (+policy.sizes.patch_size=4)")


def parse_overrides(overrides: Sequence[str]) -> list:
    """Parse each override with Hydra's grammar. Returns Hydra `Override` objects, the value of a string key as
    typed (`as_typed`: `experiment=2026_12` is the string "2026_12"; `input_line` holds the override Hydra is given).

    Raises:
        ConfigError: naming the override's key: a value with an unquoted comma (a Hydra sweep; the fix quotes it as
            the key's type needs), an override the grammar cannot read (with the forms that work), or a value of a
            string key that cannot be kept as typed (`as_typed`).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    parser = OverridesParser.create()
    out = []
    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        try:
            ov = parser.parse_override(o)
        except HydraException:
            raise _grammar_error(key, value) from None
        if ov.is_sweep_override():
            raise ConfigError(key, value, _comma_fix(key, value))
        typed = _as_typed(o, ov)
        out.append(ov if typed == o else parser.parse_override(typed))
    return out


def as_typed(overrides: Sequence[str]) -> list[str]:
    """The overrides as Hydra must be given them so that every string key keeps the text the user typed.

    Hydra's grammar reads an unquoted value by its look: `2026_12` is the integer 202612 (underscores in numbers),
    `1e3` the float 1000.0, `true` the bool True, `inf`/`nan` floats, `+5` the integer 5. For a key the schema types
    as a string (`experiment`, `run_root`, `runner.resume`, `tracking.experiment`, `sft.store`, any `str` field, an
    entry of a `dict[str, str]` such as `cluster.component_placement`) and for a config group choice (`conf=`,
    `env=`, ...), the structured config would then hold `str(value)`: "202612", "1000.0", "True" - a run directory
    and an MLflow experiment the user did not name, silently. Such a value is given to Hydra quoted (`key='2026_12'`),
    so the key holds exactly what was typed. Number and bool keys are left as Hydra reads them (`runner.max_steps=
    1_000` is 1000: what was meant); `null` stays None for an Optional string key (`policy.model_path=null`).

    Raises:
        ConfigError: as `parse_overrides`; `null` for a string key that cannot be None (the fix: give a value, or
            quote the text null); inside a dict value, an entry of a string key that Hydra reads as a bool or a
            number written otherwise than Python prints it (the fix: quote that entry).
    """
    return [ov.input_line for ov in parse_overrides(overrides)]


_SCHEMA_NODE = []  # OmegaConf.structured(Config), built once (the schema is fixed)


def _str_slot(key: str) -> bool | None:
    """Whether the schema holds a string at dotted `key`: None when it does not (another type, a section, an unknown
    key), else whether None is allowed there (Optional[str]). An entry of a dict section (a new one included) is a
    string when the dict's values are (`dict[str, str]`)."""
    from omegaconf.nodes import StringNode
    if not _SCHEMA_NODE:
        _SCHEMA_NODE.append(OmegaConf.structured(Config))
    node = _SCHEMA_NODE[0]
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_none() or node._is_missing():
            return None
        if part in node:
            node = node._get_node(part)
        elif node._metadata.element_type is str and part == key.rsplit(".", 1)[-1]:
            return False  # a new entry of a dict[str, str]
        else:
            return None
    return node._is_optional() if isinstance(node, StringNode) else None


def _as_typed(text: str, ov) -> str:
    """One override `text` (parsed: `ov`) as Hydra must be given it (`as_typed`). Raises ConfigError."""
    if ov.is_delete():
        return text
    key, value = ov.key_or_group, ov.value()
    head, _, raw = text.partition("=")
    raw = raw.strip()
    if isinstance(value, dict):
        _check_typed_entries(key, value, raw, head)
        return text
    optional = True if key in ("conf", *GROUPS) else _str_slot(key)  # a group choice is a name (null: none)
    if optional is None or isinstance(value, (str, list)):
        return text
    if value is None:
        if optional:
            return text
        raise ConfigError(key, raw, f"is a string and cannot be null; give a value (for the text {raw} itself, quote "
                                    f"it: {key}=\"'{raw}'\" in the shell)")
    return f"{head}='{raw}'"  # a bool/int/float token: plain characters, safe inside Hydra's single quotes


def _check_typed_entries(key: str, value: dict, raw: str, head: str) -> None:
    """A dict value's entries of string keys must read as typed: refuse a bool, a float, or an integer Hydra
    wrote otherwise than it was typed (`1_0`, `+1`; the raw text of an entry is not kept by Hydra's parser)."""
    import re
    for name, v in value.items():
        sub = f"{key}.{name}"
        if isinstance(v, dict):
            _check_typed_entries(sub, v, raw, head)
            continue
        if isinstance(v, str) or v is None or isinstance(v, list) or _str_slot(sub) is None:
            continue
        if isinstance(v, int) and not isinstance(v, bool) and re.search(rf"(?<![\w.+-]){v}(?![\w.])", raw):
            continue  # written as Python prints it (actor: 0): the string "0" is what was typed
        kind = "a bool" if isinstance(v, bool) else "a number"
        raise ConfigError(sub, v, f"is a string, but Hydra reads this dict entry as {kind} (its text would change); "
                                  f"quote it inside the dict: {head.lstrip('+~')}={{{name}: 'VALUE'}} (in the shell: "
                                  f"'{head}={{{name}: \"VALUE\"}}')")


def _schema_default(key: str):
    """The schema default at `key` (a dict entry's parent dict when the entry is new), or None if unknown."""
    from tasks.config import config_value
    try:
        return config_value(Config(), key)
    except KeyError:
        return None


def _expected(default) -> str | None:
    """'true or false', 'an integer' or 'a number' for a bool, int or float schema default (None otherwise)."""
    for kind, name in ((bool, "true or false"), (int, "an integer"), (float, "a number")):
        if isinstance(default, kind):
            return name
    return None


def _yaml(value) -> str:
    """A scalar as an override writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _comma_fix(key: str, value: str) -> str:
    default = _schema_default(key)
    if _expected(default) is not None:  # a number (or bool) key: a comma is no part of its value
        return f"{key} takes one value, {_expected(default)} (e.g. {key}={_yaml(default)}); no commas"
    if isinstance(default, list):
        return f"Hydra reads unbracketed commas as a sweep of runs; write the list in brackets: {key}=[{value}]"
    if isinstance(default, dict):
        return (f"Hydra reads unbracketed commas as a sweep of runs; write the dict in braces: "
                f"{key}='{{k: v, ...}}'")
    return (f"Hydra reads an unquoted comma as a sweep of runs; quote the value: {key}='\"{value}\"' "
            f"(in the shell: single quotes around double quotes) or escape the commas: {key}='{value.replace(',', chr(92) + ',')}'")


def _grammar_error(key: str, value: str) -> ConfigError:
    if "," in key:  # a dict key with commas (cluster.component_placement's "actor,env,rollout")
        parts = key.split(".")
        i = next(j for j, s in enumerate(parts) if "," in s)
        parent, name = ".".join(parts[:i]), ".".join(parts[i:])
        esc = name.replace(",", "\\,")
        return ConfigError(key, value, f"a key with commas cannot be written as a dotted key; give it inside a dict "
                                       f"value: '+{parent}={{{esc}: {value}}}'")
    if value.lstrip().startswith("{") and ("'" in value or '"' in value):
        return ConfigError(key, value, "Hydra's dict keys are unquoted; escape commas inside them instead: e.g. "
                                       "'+cluster.component_placement={actor\\,env\\,rollout: all}'")
    return ConfigError(key or "override", value, f"Hydra cannot parse this override; {QUOTING}")


def _config_error(exc: Exception, overrides: Sequence[str]) -> ConfigError:
    msg = " ".join(str(exc).split())
    for group in ("conf", *GROUPS):
        if f"in group {group}" in msg or f"Could not find '{group}/" in msg:
            names = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
            given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"{group}=")), None)  # the last wins
            if given is None:  # chosen by the experiment file's defaults list
                given = msg.split(f"Could not find '{group}/", 1)[-1].split("'", 1)[0] if f"'{group}/" in msg else "?"
            hint = did_you_mean(given, names)
            return ConfigError(group, given, f"no conf/{group}/{given}.yaml; {hint + ' ' if hint else ''}"
                                             f"available: {names}")
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None) or getattr(exc, "full_key", None)
    detail = str(cause).splitlines()[0]
    return _from_omegaconf(key, _value_for(key, overrides), detail, overrides)


def schema_keys() -> list[str]:
    """Every dotted key of the schema (`Config`): its leaves and the sections above them ("runner",
    "env.eval", "env.eval.num_envs", ...), in declaration order."""
    out: list[str] = []

    def walk(node, prefix: str) -> None:
        for name in node:
            key = f"{prefix}.{name}" if prefix else str(name)
            out.append(key)
            child = node._get_node(name)
            if isinstance(child, DictConfig) and not child._is_none() and not isinstance(_schema_default(key), dict):
                walk(child, key)
    walk(OmegaConf.structured(Config), "")
    return out


def unknown_key_fix(key: str) -> str:
    """The fix for an unknown dotted `key`: "did you mean" the schema keys at its level (its section's own keys,
    when the section exists; else the full dotted keys), then where every key is printed."""
    known = schema_keys()
    parent, _, name = key.rpartition(".")
    if parent in known or not parent:  # a typo in the last part: the section's own keys
        siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
        close = [f"{parent}.{c}" if parent else c for c in close_matches(name, siblings)]
    else:  # a typo further up (runer.max_steps): full dotted keys
        close = close_matches(key, [k for k in known if k.count(".") == key.count(".")])
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return f"unknown key; {hint}`python -m pipelines.validate --show` prints every key"


def _from_omegaconf(key, value, detail: str, overrides: Sequence[str] = ()) -> ConfigError:
    if key in REMOVED_KEYS:  # a key the schema no longer has: its own fix
        return ConfigError(key, value, REMOVED_KEYS[key])
    if "not in" in detail or "Could not override" in detail:
        parent = key.rsplit(".", 1)[0] if key and "." in key else None
        if parent is not None and isinstance(_schema_default(parent), dict):
            name = key.rsplit(".", 1)[1]
            form = (f"+{parent}={{{name.replace(',', chr(92) + ',')}: VALUE}}" if "," in name
                    else f"+{key}=VALUE, or +{parent}={{{name}: VALUE}}")
            return ConfigError(key, value, f"a new key of the dict {parent}: add it with a leading + ({form})")
        full = _given_key_under(key, overrides)  # the override's own dotted key (runer.max_steps, not runer)
        return ConfigError(full or "config", _value_for(full, overrides) if full != key else value,
                           unknown_key_fix(full) if full else "unknown key")
    if "could not be converted" in detail or "is not a valid" in detail or "Unsupported value type" in detail:
        default = _schema_default(key) if key else None
        fix = f"; give {_expected(default)} (e.g. {key}={_yaml(default)})" if _expected(default) else ""
        return ConfigError(key or "config", value, f"wrong type: {detail}{fix}")
    return ConfigError(key or "config", value, detail[:300])


def _given_key_under(key, overrides: Sequence[str]):
    """The command-line key `key` names: `key` itself when given, else the first override's key below it (OmegaConf
    names the first unknown part: `runer` for `runer.max_steps=3`), else `key`."""
    if not key:
        return key
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
    if key in keys:
        return key
    return next((k for k in keys if k.startswith(key + ".")), key)


def _value_for(key, overrides: Sequence[str]):
    """The command-line value of `key`, or of the override that set a section above it (a dict value)."""
    best = None
    for o in overrides:
        k, _, v = o.lstrip("+~").partition("=")
        if key and k == key:
            return v
        if key and key.startswith(k + "."):
            best = v
    return best


# Keys an experiment file may write as `???` (OmegaConf's mandatory value): the command line must give them
# (`check_required`); the fix printed when it does not ({experiment}: the experiment's name). Any other `???` key
# gets a generic fix.
MISSING = "???"
REQUIRED_KEYS = {
    "policy.model_path": ("experiment {experiment} starts RL from an SFT checkpoint: give "
                          "policy.model_path=<SFT run>/checkpoints/global_step_N/hf (or checkpoints/best/hf; README, "
                          "\"VLA policies\"); policy.model_path=null starts from random weights instead"),
}


def to_config(dcfg: DictConfig, *, validate: bool = True, saved: bool = False) -> Config:
    """DictConfig (already typed by the schema) -> `Config` dataclass, validated unless `validate=False`.
    `saved=True`: a run's saved resolved config (config.yaml), which may hold keys removed since
    (`tasks.config.upgrade_saved_config`); a composed config may not (REMOVED_KEYS: the fix). Raises ConfigError."""
    from omegaconf.errors import OmegaConfBaseException
    try:
        # merging a plain container re-checks every key against the schema (also keys added with `+key=`)
        plain = OmegaConf.to_container(dcfg, resolve=True)
        plain = upgrade_saved_config(plain) if saved else plain
        typed = OmegaConf.merge(OmegaConf.structured(Config), plain)
        cfg: Config = OmegaConf.to_object(typed)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise _from_omegaconf(key, OmegaConf.select(dcfg, key) if key else None, str(exc).splitlines()[0]) from None
    return cfg.validate() if validate else cfg


def load_saved_config(path, *, validate: bool = True) -> Config:
    """A run's saved resolved config (`<run dir>/config.yaml`) as `Config`: the schema (unknown keys and wrong types
    refused; keys removed since are upgraded: `to_config(saved=True)`) and, unless `validate=False`,
    `Config.validate`. The one loader of saved configs (pipelines.record's teacher, pipelines.replay's env); a
    composition from conf/ goes through `load_config`.

    Raises:
        ConfigError: as `to_config`; the file damaged (`storage.rundir.read_resolved_config`: empty, or its sha256
            differs from the digest beside it). FileNotFoundError: no file at `path`. yaml.YAMLError: not YAML.
    """
    return to_config(read_saved_config(path), validate=validate, saved=True)


def read_saved_config(path) -> DictConfig:
    """A run's saved `config.yaml` as OmegaConf, verified (`storage.rundir.read_resolved_config`): the one read of
    saved configs (load_saved_config, pipelines.eval's source config, the provenance of a checkpoint).

    Raises:
        ConfigError: the file is damaged (one line naming it and the fix). FileNotFoundError, yaml.YAMLError.
    """
    from storage.rundir import DamagedRunFile, read_resolved_config
    try:
        text = read_resolved_config(path)
    except DamagedRunFile as exc:
        raise ConfigError("config.yaml", str(path), str(exc)) from None
    return OmegaConf.create(text)


def check_components(cfg: Config, command: str = "run") -> None:
    """Validation that needs the component registries: policy name, simulator, env task, Vulkan (`command`: as
    `check_command`; a recording prompts no policy, so it may select several LIBERO tasks).

    Raises:
        ConfigError, tasks.envs.maniskill.vulkan.VulkanMissingError.
    """
    from tasks.envs import check_env_config
    from tasks.policies import check_policy_config
    from tasks.algorithms import get_estimator
    sizes = check_policy_config(cfg.policy)
    if sizes and cfg.env.obs_mode == "rgb" and cfg.env.image_size % sizes.get("patch_size", 1):
        raise ConfigError("env.image_size", cfg.env.image_size,
                          f"must be a multiple of the {cfg.policy.preset} preset's patch_size={sizes['patch_size']} "
                          f"(or override policy.sizes.patch_size)")
    if cfg.algorithm.spec is not None:  # an RL algorithm: its estimator's math is registered (not only its spec)
        try:
            get_estimator(cfg.algorithm.name)
        except ValueError as exc:
            raise ConfigError("algorithm.name", cfg.algorithm.name, f"{exc} (tasks.algorithms.estimators)") from None
    check_env_config(cfg.env)
    if cfg.policy.model_path:
        check_model_path(cfg)
    if cfg.algorithm.name == "sft":
        check_sft_store(cfg)
    if cfg.env.eval.num_envs % cfg.env.num_shards:
        raise ConfigError("env.eval.num_envs", cfg.env.eval.num_envs,
                          f"must be divisible by env.num_shards={cfg.env.num_shards} (eval envs are sharded the same way)")
    if cfg.env.simulator == "maniskill":
        from tasks.envs.maniskill.vulkan import vulkan_env
        vulkan_env()
    if cfg.env.simulator == "libero":
        check_libero_run(cfg)


def check_libero_run(cfg: Config) -> None:
    """LIBERO checks that need the whole config: envs moving between tasks (a warning on stderr, they rebuild
    their instance) and the env workers' memory (tasks.envs.libero.adapter). Raises ConfigError."""
    import sys

    import tasks.envs.libero.adapter as libero
    from tasks.resident import memory_limit_bytes
    from tasks.rollout import group_size
    e, c = cfg.env, cfg.cluster
    for w in libero.check_run(e.num_envs, group_size(cfg), len(libero.task_ids(e)), e.eval.num_envs):
        print(f"warning: {w}", file=sys.stderr)
    limit = c.memory_limit
    limit_bytes = memory_limit_bytes(limit)
    # SFT rolls nothing out: its env workers hold eval envs only
    libero.check_memory(shard_size=0 if cfg.algorithm.name == "sft" else e.shard_size, eval_shard_size=e.eval.num_envs // e.num_shards,
                        num_shards=e.num_shards, num_env_workers=c.num_env_workers, memory_limit_bytes=limit_bytes,
                        memory_limit=str(limit))


def check_model_path(cfg: Config) -> None:
    """policy.model_path's config.json against the config: family, image size, chunk length, gripper convention,
    the env it was trained on (`check_source_env`: config.json `env`, completed by its run's config.yaml) and the
    state / action lengths the env's adapter knows offline. Raises ConfigError."""
    import json
    import os
    from storage.checkpoints import export_damage
    p, key = cfg.policy, "policy.model_path"
    damage = export_damage(p.model_path)
    if damage:
        raise ConfigError(key, p.model_path, f"is damaged: {damage}; export it again or use another checkpoint "
                                             f"(a run keeps one hf/ per checkpoint: RUN/checkpoints/global_step_N/hf)")
    try:
        meta = json.loads(open(os.path.join(p.model_path, "config.json")).read())
    except (OSError, ValueError) as exc:
        raise ConfigError(key, p.model_path, f"its config.json is unreadable ({type(exc).__name__}: {exc}); export "
                                             f"it again or use another checkpoint") from None
    if meta.get("family") != p.name:
        raise ConfigError(key, p.model_path, f"holds a {meta.get('family')!r} checkpoint; policy.name={p.name}")
    want = cfg.env.image_size if cfg.env.obs_mode == "rgb" else None
    if meta.get("image_size") != want:
        raise ConfigError(key, p.model_path, f"was saved for image_size={meta.get('image_size')}, this config gives "
                                             f"{want} (env.obs_mode={cfg.env.obs_mode}, env.image_size)")
    saved_c = meta.get("policy", {}).get("num_action_chunks")
    if saved_c != p.num_action_chunks:
        raise ConfigError(key, p.model_path, f"was saved with policy.num_action_chunks={saved_c}, this config has "
                                             f"{p.num_action_chunks}")
    from tasks.envs import check_gripper_convention, state_dim
    check_gripper_convention(key, p.model_path, (meta.get("env") or {}).get("gripper_convention"), cfg.env)
    src = model_source_env(p.model_path, meta)
    if cfg.env.simulator == "libero" and src.get("simulator") == "libero":
        # LIBERO's suites share the robot, its state and its actions, and a VLA is instruction-conditioned: a
        # checkpoint of one suite is evaluated or fine-tuned on another (libero_90 -> libero_10), as the papers do
        src.pop("env_id", None)
    check_source_env(key, p.model_path, src, cfg.env, made="trained")
    want_o = state_dim(cfg.env)
    if want_o is not None and meta.get("obs_dim") not in (None, want_o):
        raise ConfigError(key, p.model_path, f"reads a {meta['obs_dim']}-D state, this env gives {want_o}-D "
                                             f"({_state_hint(cfg.env, meta['obs_dim'])})")
    want_a = known_action_dim(cfg.env)
    if want_a is not None and meta.get("action_dim") not in (None, want_a):
        raise ConfigError(key, p.model_path, f"outputs {meta['action_dim']}-D actions, env.simulator="
                                             f"{cfg.env.simulator} takes {want_a}-D ones: use a checkpoint trained "
                                             f"on this simulator")


# What a demo store (its attrs) and a policy checkpoint (config.json `env`, its run's config.yaml) record of the env
# they were made on, compared with the configured env before anything starts. Each decides the layout of the data:
# the simulator and env task the state vector and the prompts' task table (LIBERO: a stored task_id indexes its
# suite's tasks), the control mode the action vector (ManiSkill PushCube-v1: pd_joint_delta_pos 8-D,
# pd_ee_delta_pos 4-D). ManiSkill's state and action lengths are known only once an env is built
# (tasks.rollout.env_dims, on a worker), so offline these recorded names are what shows a mismatch; LIBERO's
# lengths are also checked directly (state_dim, known_action_dim). A name not recorded (stores and exports written
# before it was) is not compared.
SOURCE_ENV_KEYS = ("simulator", "env_id", "control_mode")
SOURCE_ENV_WHY = {"simulator": "another simulator's observations and actions",
                  "env_id": "another env task's observations and instructions",
                  "control_mode": "another controller's actions, of another meaning and length"}


def check_source_env(key: str, value, recorded: dict, env, *, made: str) -> None:
    """Refuse a store or checkpoint (`key`=`value`) whose `recorded` env (SOURCE_ENV_KEYS -> value; absent or None:
    not recorded) differs from `env` (EnvConfig). `made`: "recorded" (a store) or "trained" (a checkpoint).

    Raises:
        ConfigError(key, value): one line naming each differing env.KEY with the recorded and the configured value,
            and the fix: make the data with this env, or set env.KEY to the recorded value.
    """
    diff = [(k, recorded[k], getattr(env, k)) for k in SOURCE_ENV_KEYS
            if recorded.get(k) is not None and recorded[k] != getattr(env, k)]
    if not diff:
        return
    have = ", ".join(f"env.{k}={r}" for k, r, _ in diff)
    want = ", ".join(f"env.{k}={w}" for k, _, w in diff)
    why = "; ".join(SOURCE_ENV_WHY[k] for k, _, _ in diff)
    redo = "record the demos" if made == "recorded" else "train a checkpoint"
    if any(k == "simulator" for k, _, _ in diff):  # not one key to set: a whole env group of that simulator
        fix = f"{redo} with this env, or choose an env group of {diff[0][1]} (env=NAME)"
    else:
        fix = (f"{redo} with {' and '.join(f'env.{k}={w}' for k, _, w in diff)}, or set "
               f"{' '.join(f'env.{k}={r}' for k, r, _ in diff)} to match it")
    raise ConfigError(key, value, f"was {made} with {have}, this config has {want} ({why}); {fix}")


def model_source_env(model_path, meta: dict) -> dict:
    """What a checkpoint records of the env it was trained on: config.json `env` (hf/ exports: simulator, env_id,
    gripper_convention: pipelines.graphs.export_env_meta), completed by the `env` section of its run's saved
    config.yaml when `model_path` is a run's checkpoint (`RUN/checkpoints/global_step_N/hf`, `.../best/hf`), which
    also names the control mode. {} when neither says anything; an unreadable config.yaml adds nothing."""
    from pathlib import Path
    out = {k: v for k, v in (meta.get("env") or {}).items() if v is not None}
    try:
        hf = Path(model_path).resolve()
        ckpt = hf.parent if hf.name == "hf" else hf
        saved = ckpt.parent.parent / "config.yaml"
        if ckpt.parent.name == "checkpoints" and saved.is_file():
            run_env = OmegaConf.to_container(read_saved_config(saved)).get("env") or {}
            out = {**{k: run_env[k] for k in SOURCE_ENV_KEYS if run_env.get(k) is not None}, **out}
    except Exception:  # noqa: BLE001 - not a run's checkpoint after all (or a damaged config.yaml): config.json only
        pass
    return out


def known_action_dim(env) -> int | None:
    """The action length of `env` (EnvConfig) when its adapter knows it offline (LIBERO: 7), else None
    (ManiSkill: the controller's, known once an env is built: tasks.rollout.env_dims)."""
    if env.simulator == "libero":
        from tasks.envs.libero.adapter import ACTION_DIM
        return ACTION_DIM
    return None


def _state_hint(env, other_dim: int) -> str:
    """The fix for a state of another length: LIBERO's env.object_state makes the 8- or 14-D state."""
    if env.simulator == "libero":
        from tasks.envs.libero.adapter import OBJECT_STATE_DIM, OBS_DIM
        if other_dim in (OBS_DIM, OBS_DIM + OBJECT_STATE_DIM):
            return f"set env.object_state={str(other_dim != OBS_DIM).lower()}"
    return "record or train with the same env settings"


def check_sft_store(cfg: Config) -> None:
    """sft.store against the config: gripper convention, the env it was recorded on (`check_source_env`: simulator,
    env task, control mode), state length, chunk length, images, and at least one selectable chunk step.

    Raises ConfigError (sft.store) for each mismatch, and for a store that cannot be read (damaged metadata or
    chunk files: a half-copied or corrupted store; every chunk file of every field the run reads, `sft_fields`, is
    checked to exist) naming the error and the fix."""
    from storage.trajectories import DamagedStore
    try:
        _check_sft_store(cfg)
    except ConfigError:
        raise
    except DamagedStore as exc:  # e.g. its group metadata unreadable: the message names the damage and the fix
        raise ConfigError("sft.store", cfg.sft.store, str(exc).split(": ", 1)[-1]) from None
    except Exception as exc:  # noqa: BLE001 - zarr/numcodecs/json errors of a damaged store: one line naming it
        raise ConfigError("sft.store", cfg.sft.store, f"cannot be read ({type(exc).__name__}: "
                                                      f"{' '.join(str(exc).split())[:200]}): the store is damaged "
                                                      f"or incompletely copied; record it again or copy it whole") \
            from None
    check_sft_memory(cfg)  # a store that passed the checks above reads


def _check_sft_store(cfg: Config) -> None:
    from storage.rundir import store_owner
    from storage.trajectories import TrajectoryStore
    from tasks.demo_index import DamagedStore, sft_fields, sft_index
    from tasks.envs import check_gripper_convention, state_dim
    busy = store_owner(cfg.sft.store, readers=False)  # a recording writes it (record.out or its .partial)
    if busy is not None:
        raise ConfigError("sft.store", cfg.sft.store, busy)
    st = TrajectoryStore.open(cfg.sft.store)
    if "teacher_run" in st.attrs and "episode_index" not in st.attrs:  # pipelines.record writes it last
        raise ConfigError("sft.store", cfg.sft.store, "is a recording that did not finish (pipelines.record was "
                                                      "interrupted or failed before writing its episode index); "
                                                      "record again to a new record.out")
    check_gripper_convention("sft.store", cfg.sft.store, st.attrs.get("gripper_convention"), cfg.env)
    check_source_env("sft.store", cfg.sft.store, {k: st.attrs.get(k) for k in SOURCE_ENV_KEYS}, cfg.env,
                     made="recorded")
    stored_reward = st.attrs.get("reward_mode")
    if cfg.sft.value_coef > 0 and stored_reward is not None and stored_reward != cfg.env.reward_mode:
        raise ConfigError("sft.store", cfg.sft.store,
                          f"stores rewards of env.reward_mode={stored_reward}, this config has env.reward_mode="
                          f"{cfg.env.reward_mode}: sft.value_coef={cfg.sft.value_coef} would fit the critic an RL run "
                          f"starts from to the other reward's scale; record with env.reward_mode="
                          f"{cfg.env.reward_mode}, set env.reward_mode={stored_reward}, or sft.value_coef=0")
    want_o, obs = state_dim(cfg.env), st.fields.get("obs")
    if want_o is not None and obs is not None and obs.shape[0] != want_o:
        raise ConfigError("sft.store", cfg.sft.store, f"stores a {obs.shape[0]}-D state, this env gives {want_o}-D "
                                                      f"({_state_hint(cfg.env, obs.shape[0])})")
    C = cfg.policy.num_action_chunks
    act = st.fields.get("actions")
    if act is None or act.shape[0] != C:
        raise ConfigError("sft.store", cfg.sft.store, f"stores action chunks of {None if act is None else act.shape[0]}, "
                                                      f"policy.num_action_chunks={C}; record with the same C")
    if cfg.env.obs_mode == "rgb":
        rgb = st.fields.get("rgb")
        if rgb is None or rgb.shape[:2] != (cfg.env.image_size, cfg.env.image_size):
            raise ConfigError("sft.store", cfg.sft.store,
                              f"has {'no images' if rgb is None else f'{rgb.shape[0]} px images'}, the config wants "
                              f"env.image_size={cfg.env.image_size}")
        stored_lod = float(st.attrs.get("robot_visual_lod", 1.0))  # stores before the key: the original meshes
        if stored_lod != cfg.env.robot_visual_lod:
            import warnings
            warnings.warn(f"sft.store={cfg.sft.store}: its images show the arm at robot_visual_lod={stored_lod}, "
                          f"this run renders env.robot_visual_lod={cfg.env.robot_visual_lod} (its evals see slightly "
                          f"different images: README 'Rendering cost'); set env.robot_visual_lod={stored_lod} to match",
                          stacklevel=2)
    try:
        sft_index(cfg.sft.store, cfg.sft.only_success)
        # every chunk file the run's data workers will read, stat only (they read through the same check)
        st.check_files(sft_fields(st.fields, cfg.sft.only_success, cfg.sft.value_coef > 0))
    except DamagedStore as exc:  # its message names the damage and the fix
        raise ConfigError("sft.store", cfg.sft.store, str(exc).split(": ", 1)[-1]) from None
    except ValueError as exc:
        raise ConfigError("sft.store", cfg.sft.store, f"{str(exc).split(': ', 1)[-1]}; record more episodes or set "
                                                      f"sft.only_success=false") from None


def check_sft_memory(cfg: Config) -> None:
    """The samples an SFT data worker caches (`tasks.demos._dataset`: with `sft.value_coef` > 0 every executed
    chunk step, else the selected ones) against `cluster.memory_limit`: their estimate
    (`tasks.demo_index.sft_dataset_bytes`) plus the worker's own memory (`SFT_WORKER_BASE_GIB`, measured; a LIBERO
    worker's eval envs by `tasks.envs.libero.adapter.shard_memory_gib`) must stay under Dask's pause / restart fraction of
    the limit. Without the check a too-large store (e.g. a long RL run's trajectories) had the data workers
    restarted on every retry of step 1. Raises ConfigError (sft.store) with the limit that fits."""
    import math

    from tasks.demo_index import SFT_WORKER_BASE_GIB, sft_dataset_bytes, sft_index
    from tasks.resident import memory_bound, memory_limit_bytes
    limit = memory_limit_bytes(cfg.cluster.memory_limit)
    if not limit:
        return
    value = cfg.sft.value_coef > 0
    rows = len(sft_index(cfg.sft.store, cfg.sft.only_success and not value))
    data_gib = sft_dataset_bytes(cfg.sft.store, rows) / 2 ** 30
    base_gib = SFT_WORKER_BASE_GIB
    if cfg.env.simulator == "libero":
        import tasks.envs.libero.adapter as libero
        per_worker = -(-cfg.env.num_shards // max(cfg.cluster.num_env_workers, 1))
        base_gib = libero.shard_memory_gib(per_worker * (cfg.env.eval.num_envs // cfg.env.num_shards))
    frac, what = memory_bound()
    need = base_gib + data_gib
    if need > frac * limit / 2 ** 30:
        raise ConfigError("sft.store", cfg.sft.store,
                          f"its {rows} chunk steps{' (every executed one: sft.value_coef > 0)' if value else ''} take "
                          f"~{data_gib:.1f} GiB in each SFT data worker, ~{need:.1f} GiB with the worker's own "
                          f"{base_gib:.1f} GiB: more than {frac:.0%} of "
                          f"cluster.memory_limit={cfg.cluster.memory_limit} (Dask's memory {what} fraction); "
                          f"set cluster.memory_limit={math.ceil(need / frac)}GiB, or train on a smaller store")


COMMAND_LINE = "the command line"


def experiment_name(overrides: Sequence[str] = ()) -> str:
    """The experiment file `conf=NAME` selects (the last one given), else conf/config.yaml's default."""
    for o in reversed(list(overrides)):
        k, _, v = o.lstrip("+").partition("=")
        if k == "conf":
            return v
    defaults = OmegaConf.load(CONF_DIR / "config.yaml").get("defaults", [])
    return next(d["conf"] for d in defaults if isinstance(d, (dict, DictConfig)) and "conf" in d)


def _leaves(value, prefix: str) -> list[str]:
    """Dotted keys of the leaves of a (nested) dict value under `prefix`; a list or scalar is one leaf."""
    if isinstance(value, (dict, DictConfig)) and len(value):
        return [k for name, v in value.items() for k in _leaves(v, f"{prefix}.{name}" if prefix else str(name))]
    return [prefix]


GROUPS = ("env", "policy", "algorithm", "cluster")  # config groups: conf/GROUP/NAME.yaml, package GROUP


def _group_choice(entry) -> tuple[str, str | None] | None:
    """(group, choice) of an experiment's defaults-list entry `override /GROUP: NAME`, else None."""
    if not isinstance(entry, (dict, DictConfig)) or len(entry) != 1:
        return None
    (key, choice), = entry.items()
    group = str(key).replace("override", "").strip().lstrip("/")
    return (group, choice) if group in GROUPS else None


def _file_values(path: Path, package: str) -> dict:
    """Dotted key -> value a conf file sets under `package` ("" for `_global_`): its own leaves and, first, those
    of the files of the same group its defaults list includes (`- NAME`); `defaults` itself is not a key. Values
    as written (a `???` stays the string "???")."""
    node = OmegaConf.to_container(OmegaConf.load(path))  # plain, unresolved: a `???` value is a key too
    out: dict = {}
    for entry in node.get("defaults", []) if package else []:
        if isinstance(entry, str) and entry != "_self_":
            out.update(_file_values(path.parent / f"{entry}.yaml", package))
    body = {k: v for k, v in node.items() if k != "defaults"}
    for key in _leaves(body, package) if body else []:
        value = body
        for part in key[len(package) + 1 if package else 0:].split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[key] = value
    return out


def _file_keys(path: Path, package: str) -> list[str]:
    """The dotted keys of `_file_values(path, package)`."""
    return list(_file_values(path, package))


def group_choices(overrides: Sequence[str] = ()) -> dict[str, tuple[str, str]]:
    """The config group files of this composition: group -> (choice, who chose it: "the command line" or
    "conf/conf/NAME.yaml"). A command-line `GROUP=NAME` wins over the experiment's `override /GROUP: NAME`; groups
    nobody chose (null in conf/config.yaml) are absent. Raises ConfigError for an override Hydra cannot parse."""
    name = experiment_name(overrides)
    path = CONF_DIR / "conf" / f"{name}.yaml"
    out: dict[str, tuple[str, str]] = {}
    if path.is_file():
        for entry in OmegaConf.load(path).get("defaults", []):
            gc = _group_choice(entry)
            if gc is not None and gc[1] is not None:
                out[gc[0]] = (str(gc[1]), f"conf/conf/{name}.yaml")
    for ov in parse_overrides(overrides):
        if ov.key_or_group in GROUPS and not ov.is_delete() and not isinstance(ov.value(), (dict, list)):
            if ov.value() is None:
                out.pop(ov.key_or_group, None)
            else:
                out[ov.key_or_group] = (str(ov.value()), COMMAND_LINE)
    return out


def given_keys(overrides: Sequence[str] = ()) -> dict[str, str]:
    """Every key SET for this composition -> where: "the command line", "conf/conf/NAME.yaml", or for a group file
    "conf/GROUP/CHOICE.yaml (chosen by conf/conf/NAME.yaml)" / "conf/GROUP/CHOICE.yaml (chosen on the command line)".

    A group file's keys count as set by whoever chose it (the experiment, or the command line for `GROUP=CHOICE`:
    `from_command_line`).
    Later sources win, as in Hydra's merge: group files, then the experiment file, then command-line keys. A dict
    value counts as its leaf keys (`+a={b: 1}` sets `a.b`); `conf=` and `GROUP=` themselves are not keys. Raises
    ConfigError for an override Hydra cannot parse.
    """
    name = experiment_name(overrides)
    out: dict[str, str] = {}
    for group, (choice, who) in group_choices(overrides).items():
        gpath = CONF_DIR / group / f"{choice}.yaml"
        if gpath.is_file():  # an unknown choice is compose's error
            where = f"conf/{group}/{choice}.yaml ({'chosen on ' if who == COMMAND_LINE else 'chosen by '}{who})"
            out.update({k: where for k in _file_keys(gpath, group)})
    path = CONF_DIR / "conf" / f"{name}.yaml"
    if path.is_file():
        out.update({k: f"conf/conf/{name}.yaml" for k in _file_keys(path, "")})
    for ov in parse_overrides(overrides):
        if ov.key_or_group == "conf" or ov.is_delete() or ov.key_or_group in GROUPS:
            continue
        out.update({k: COMMAND_LINE for k in _leaves(ov.value(), ov.key_or_group)})
    return out


def check_required(overrides: Sequence[str] = ()) -> None:
    """The keys the experiment file (or a group file it chooses) writes as `???` must be given on the command line.
    (Hydra's merge keeps the value below a `???`, so the composed config cannot say; the files are read here.)

    Raises:
        ConfigError: the first such key not given, with its fix (REQUIRED_KEYS) and "???" as the value.
    """
    name = experiment_name(overrides)
    files = [(CONF_DIR / group / f"{choice}.yaml", group) for group, (choice, who) in group_choices(overrides).items()
             if who != COMMAND_LINE]
    files.append((CONF_DIR / "conf" / f"{name}.yaml", ""))
    given = given_keys(overrides)
    for path, package in files:
        if not path.is_file():  # an unknown choice is compose's error
            continue
        for key, value in _file_values(path, package).items():
            if value == MISSING and not from_command_line(given.get(key, "")):
                raise ConfigError(key, MISSING, REQUIRED_KEYS.get(
                    key, "the experiment leaves it to the command line (???): give {key}=VALUE").format(
                    experiment=name, key=key))


def from_command_line(where: str) -> bool:
    """Whether a `given_keys` location is the command line: a key given there, or a group file chosen there."""
    return where == COMMAND_LINE or where.endswith(f"(chosen on {COMMAND_LINE})")


# Keys a group file sets for every use of its group, not refused where the experiment makes them do nothing: an env
# file describes its env for every command and algorithm (the eval envs, auto_reset, ignore_terminations do nothing
# in a recording or SFT); a policy file gives both noise methods' settings (an experiment selecting
# policy.noise_method=flow_sde makes the file's flow_noise std bounds inert, and the other way round). The same keys
# set by an experiment file or on the command line are still refused.
GROUP_FILE_DEFAULTS = {
    "conf/env/": ("env.eval", "env.auto_reset", "env.ignore_terminations"),
    "conf/policy/": ("policy.noise_std_min", "policy.noise_std_max", "policy.noise_level"),
}


def check_given(cfg: Config, overrides: Sequence[str] = (), command: str = "run", cuda_count: int = 0,
                notes: list[str] | None = None) -> None:
    """Refuse a SET key that does nothing (`tasks.config.inert_keys`; the rules: this module's docstring).

    `notes` receives one line per experiment-file key that a command-line override switched off (printed to
    stderr when `notes` is None).

    Raises:
        ConfigError: naming the key, its value, where it was set, why it does nothing and the fix.
    """
    import sys
    from tasks.config import config_value, inert_keys, inert_reason
    given = given_keys(overrides)
    inert = inert_keys(cfg, command, cuda_count)
    file_inert = None
    for key, where in given.items():
        why = inert_reason(key, inert)
        if why is None or any(where.startswith(src) and any(key == k or key.startswith(k + ".") for k in keys)
                              for src, keys in GROUP_FILE_DEFAULTS.items()):
            continue
        try:
            value = config_value(cfg, key)
        except KeyError:
            value = None
        if from_command_line(where):
            raise ConfigError(key, value, why if where == COMMAND_LINE else f"(set in {where}) {why}")
        if file_inert is None:  # the experiment as its file writes it, without the command line
            name = experiment_name(overrides)
            file_inert = inert_keys(to_config(compose([f"conf={name}"]), validate=False), command,
                                    cuda_count)
        if inert_reason(key, file_inert) is not None:
            raise ConfigError(key, value, f"(set in {where}) {why}")
        line = f"note: {key}={value!r} (set in {where}) does nothing with the command line's overrides: {why}"
        if notes is None:
            print(line, file=sys.stderr)
        else:
            notes.append(line)


def check_command(cfg: Config, command: str = "run", *, require_teacher: bool = True) -> None:
    """The checks of one command that need no cluster (run: the config trains something; record: the teacher,
    the output path: `check_record`). Raises ConfigError."""
    if command == "run":
        if cfg.env.obs_mode == "rgb" and cfg.policy.name == "mlp":
            raise ConfigError("policy.name", cfg.policy.name,
                              "the mlp reads only the state vector, env.obs_mode=rgb would render images for nothing: "
                              "use policy.name=flow_vla|token_vla (or `python -m pipelines.record` for a record conf)")
    elif command == "record":
        check_record(cfg, require_teacher=require_teacher)
    else:
        raise ValueError(f"command {command!r}: use 'run' or 'record'")


# The checks of `pipelines.record` that need no cluster: the teacher run, the output path (this module, so that
# the one check path imports nothing of the command it checks).

def resolve_teacher(arg: str, run_root: str) -> tuple[Path, Path]:
    """(run directory, latest checkpoint) of a teacher run given as a directory or a run id.

    Raises:
        ConfigError (key record.teacher): no such run, no config.yaml, or no checkpoint.
    """
    from storage.checkpoints import latest_checkpoint
    from storage.rundir import find_run_dir
    if arg is None:
        raise ConfigError("record.teacher", arg, "name the teacher run: record.teacher=runs/<experiment>/<run_id> "
                                                  "or its run id (or a scripted expert: scripted:libero)")
    p = Path(arg)
    if not p.is_dir():
        try:
            p = find_run_dir(run_root, arg)
        except (FileNotFoundError, ValueError) as exc:
            raise ConfigError("record.teacher", arg, f"no such run directory or run id under {run_root} ({exc})")
    if not (p / "config.yaml").is_file():
        raise ConfigError("record.teacher", arg, f"{p} has no config.yaml: not a dagrl run directory")
    ckpt = latest_checkpoint(p)
    if ckpt is None:
        raise ConfigError("record.teacher", arg, f"{p} has no complete checkpoint yet")
    return p, ckpt


def teacher_config(run_dir: Path) -> Config:
    """The teacher run's resolved config as a `Config` (validated against today's schema; `load_saved_config`)."""
    return load_saved_config(run_dir / "config.yaml")  # older runs: keys removed since are upgraded


def record_output_path(cfg: Config) -> Path:
    """Where `pipelines.record` writes its store: `record.out`, else `<run_root>/demos/<experiment>.zarr`."""
    return Path(cfg.record.out or Path(cfg.run_root) / "demos" / f"{cfg.experiment}.zarr")


def check_record(cfg: Config, *, require_teacher: bool = True) -> None:
    """Every check of a recording that needs no cluster (`check_command`, command "record").
    `require_teacher=False` (pipelines.validate of a record conf without `record.teacher`): everything but the
    teacher's checks. Raises ConfigError (one line, nothing written)."""
    if cfg.env.obs_mode != "rgb":
        raise ConfigError("env.obs_mode", cfg.env.obs_mode, "record with env.obs_mode=rgb (images for a VLA)")
    if cfg.record.num_episodes < 1:
        raise ConfigError("record.num_episodes", cfg.record.num_episodes, "must be >= 1")
    if cfg.record.action_noise < 0:
        raise ConfigError("record.action_noise", cfg.record.action_noise, "must be >= 0 (a std in action units)")
    if record_output_path(cfg).exists():
        raise ConfigError("record.out", str(record_output_path(cfg)),
                          "exists; choose another path (a store is never overwritten)")
    from storage.rundir import store_owner
    busy = store_owner(record_output_path(cfg))  # another recording to it, or a live run reading it (sft.store)
    if busy is not None:
        raise ConfigError("record.out", str(record_output_path(cfg)), busy)
    if cfg.record.teacher is None and not require_teacher:
        return
    from tasks.envs import check_scripted_teacher, is_scripted_teacher
    if is_scripted_teacher(cfg.record.teacher):  # scripted:NAME, e.g. scripted:libero
        check_scripted_teacher(cfg.record.teacher, cfg.env)
        return
    if cfg.record.action_noise:
        raise ConfigError("record.action_noise", cfg.record.action_noise,
                          "applies to scripted teachers (record.teacher=scripted:NAME); a trained teacher samples "
                          "its own noise with record.deterministic=false")
    run_dir, ckpt = resolve_teacher(cfg.record.teacher, cfg.run_root)
    from storage.checkpoints import checkpoint_damage, played_policy_key
    why = checkpoint_damage(ckpt, keys=(played_policy_key(ckpt),))  # offline, before a cluster starts or the store is created
    if why:
        raise ConfigError("record.teacher", cfg.record.teacher, f"{why}; move the damaged checkpoint aside (the "
                                                                f"teacher is the run's newest complete one) or name "
                                                                f"another teacher run")
    tcfg = teacher_config(run_dir)
    if tcfg.policy.name != "mlp" or tcfg.env.obs_mode != "state":
        raise ConfigError("record.teacher", cfg.record.teacher,
                          f"is a {tcfg.policy.name} run on {tcfg.env.obs_mode} observations; the recorder runs a "
                          f"state-based mlp teacher (e.g. the default job's run)")
    for key in ("env_id", "control_mode"):
        if getattr(tcfg.env, key) != getattr(cfg.env, key):
            raise ConfigError(f"env.{key}", getattr(cfg.env, key),
                              f"the teacher was trained with env.{key}={getattr(tcfg.env, key)}; use the same")


def command_for(overrides: Sequence[str] = ()) -> str:
    """The command an experiment is for, as `pipelines.validate` infers it: "record" when its experiment file sets
    `record.*` keys (conf=pushcube_record), else "run" (then `record.*` on the command line is refused as by run)."""
    where = given_keys(overrides)
    return "record" if any(k.startswith("record.") and not from_command_line(w) for k, w in where.items()) else "run"


def load_config(overrides: Sequence[str] = (), *, components: bool = True, command: str = "run",
                require_teacher: bool = True, notes: list[str] | None = None) -> tuple[Config, DictConfig]:
    """Compose, type, validate: THE check path of `pipelines.run`, `pipelines.validate` and `pipelines.record`.

    In order: Hydra's grammar (`parse_overrides`), the schema (`compose`, the experiment's `???` keys:
    `check_required`, `to_config`), combinations
    (`Config.validate`), then with `components`: registries, env task, Vulkan, model_path, sft.store
    (`check_components`), the placement against the devices (`pipelines.cluster.check_placement`, including the
    placement entries that would do nothing) and the command's checks (`check_command`); last, keys that were set
    but do nothing (`check_given`; `notes` as there). `components=False` is the schema + combinations +
    set-but-inert check only (tests, tools).

    Returns (Config, the resolved DictConfig for saving/logging). Raises ConfigError (or VulkanMissingError).
    """
    dcfg = compose(overrides)
    check_required(overrides)
    cfg = to_config(dcfg)
    cuda = 0
    if components:
        check_components(cfg, command)
        from pipelines.cluster import _cuda_device_count, check_placement
        cuda = _cuda_device_count()
        check_placement(cfg, cuda, command=command)
        check_command(cfg, command, require_teacher=require_teacher)
    check_given(cfg, overrides, command, cuda, notes)
    check_params(cfg)
    return cfg, dcfg


def check_params(cfg: Config) -> None:
    """The config as MLflow params (`storage.tracking.flatten_config`) is valid, so that no run is refused by MLflow
    after its cluster started. Raises ConfigError naming the key."""
    from storage.tracking import flatten_config
    try:
        flatten_config(to_dict(cfg))
    except ValueError as exc:
        raise ConfigError("config", None, f"cannot be logged as MLflow params: {exc}") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
