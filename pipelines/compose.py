"""Compose (Hydra) and type: the config as the command line and conf/ make it, with the provenance of every key.

`compose` composes conf/config.yaml and the groups against the union of every family's keys; `to_config` picks
each family section's class from the composed selector (pipelines.families) and runs every check once
(`tasks.config.check_config`); `given_keys` says where each set key came from, and `check_given` refuses a set key
that does nothing (the rules: `pipelines.config`'s docstring). `pipelines.config.load_config` is the one entry
of the commands; saved run configs load through `pipelines.saved_config.load_saved_config` (the same `to_config`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from tasks.config import Config, ConfigError, close_matches, did_you_mean, retired_option

from pipelines.overrides import GROUPS, _expected, _schema_default, _yaml, as_typed, parse_overrides  # noqa: F401

from pipelines import compose_memo as memo
from pipelines.families import CONF_DIR  # noqa: F401  (conf/; one definition)
SCHEMA_NAME = "dagrl_schema"


def register_schema() -> None:
    """Register `Config` in Hydra's ConfigStore as `dagrl_schema` (the first entry of conf/config.yaml's defaults).
    Stores again only when the union schema changed (a family registered) or the store's entry was replaced."""
    from hydra.core.config_store import ConfigStore
    from pipelines.families import schema_node, union_schema
    store, cls, name = ConfigStore.instance(), union_schema(), f"{SCHEMA_NAME}.yaml"
    if memo.STORED and memo.STORED[0][0] is cls and store.repo.get(name) is memo.STORED[0][1]:
        return  # Hydra deep-copies the stored node at every load: it is never written
    # every family's keys (pipelines.families); writable: the frozen sections' nodes are read-only in OmegaConf
    store.store(name=SCHEMA_NAME, node=schema_node(cls))
    memo.STORED[:] = [(cls, store.repo[name])]


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose conf/config.yaml with command-line overrides (`conf=NAME`, `a.b=value`, `+new=...`). The composed
    `experiment` is NAME (conf/conf/NAME.yaml, the default experiment's without `conf=`) unless set. Memoised
    (pipelines.compose_memo): each call returns a fresh DictConfig the caller may edit.

    Raises:
        ConfigError: unknown key, wrong type, unknown `conf` name, or an override Hydra cannot parse (named, with
            the quoting that works: `parse_overrides`).
    """
    import copy
    from pipelines.families import union_schema
    key = (str(CONF_DIR), memo.conf_digest(Path(CONF_DIR)), union_schema(), tuple(overrides))
    return copy.deepcopy(memo.once("composed", key, lambda: _compose(overrides)))


def _compose(overrides: Sequence[str], *, in_two_stages: bool = True) -> DictConfig:
    """`compose` without the memo. `in_two_stages`: the group choices composed by Hydra once per set of choices
    (kept), the value overrides applied to a copy by Hydra's own function (pipelines.compose_values: the same
    result); False: one Hydra composition of everything."""
    import copy

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipelines import compose_values
    from pipelines.families import union_schema
    typed = as_typed(overrides)  # Hydra's grammar; strings kept as typed (`as_typed`)
    for group, (choice, who) in group_choices(overrides).items():  # `_NAME.yaml`: an include, never a choice
        if choice.startswith("_"):
            raise ConfigError(group, choice, f"conf/{group}/{choice}.yaml is included by other presets, not one to "
                                             f"choose ({who}); choose one of {choices(group)}")
    try:
        if in_two_stages:
            groups, values = compose_values.split(typed, Path(CONF_DIR))
            key = (str(CONF_DIR), memo.conf_digest(Path(CONF_DIR)), union_schema(), tuple(groups))
            dcfg = compose_values.apply(copy.deepcopy(memo.once("groups", key, lambda: _hydra(groups))), values)
        else:
            dcfg = _hydra(typed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise _config_error(exc, overrides) from None
    name = experiment_name(overrides)  # `experiment` is the experiment file's name unless a file or override sets it
    if (CONF_DIR / "conf" / f"{name}.yaml").is_file() and "experiment" not in given_keys(overrides):
        dcfg.experiment = name
    from pipelines.overrides import empty_dicts  # `key={}` empties the experiment's dict (Hydra would merge it)
    for key in empty_dicts(typed):
        OmegaConf.update(dcfg, key, {}, merge=False)
    return dcfg


def _hydra(typed: Sequence[str]) -> DictConfig:
    """One Hydra composition of conf/config.yaml with `typed` overrides (Hydra's grammar). Raises Hydra's and
    OmegaConf's exceptions (`_compose` names them)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    register_schema()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(typed))


def choices(group: str) -> list[str]:
    """The options of config group `group` a user may choose: conf/GROUP/*.yaml, less the includes (`_NAME.yaml`)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def _config_error(exc: Exception, overrides: Sequence[str]) -> ConfigError:
    msg = " ".join(str(exc).split())
    for group in ("conf", *GROUPS):
        if f"in group {group}" in msg or f"Could not find '{group}/" in msg:
            names = choices(group)
            given = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(f"{group}=")), None)  # the last wins
            if given is None:  # chosen by the experiment file's defaults list
                given = msg.split(f"Could not find '{group}/", 1)[-1].split("'", 1)[0] if f"'{group}/" in msg else "?"
            if retired_option(group, given):  # one line naming what replaced it, not the list
                return ConfigError(group, given, retired_option(group, given))
            hint = did_you_mean(given, names)
            return ConfigError(group, given, f"no conf/{group}/{given}.yaml; {hint + ' ' if hint else ''}"
                                             f"available: {names}")
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None) or getattr(exc, "full_key", None)
    detail = str(cause).splitlines()[0]
    return _from_omegaconf(key, _value_for(key, overrides), detail, overrides)


def schema_keys() -> list[str]:
    """Every dotted key of the schema (`Config`): its leaves and the sections above them ("runner",
    "env.eval", "env.eval.num_envs", ...), in declaration order. Listed once per union schema (a family
    registered since makes a new one: pipelines.compose_memo); a new list each call."""
    from pipelines.families import union_schema
    cls = union_schema()
    return list(memo.once("schema_keys", cls, lambda: tuple(_schema_keys(cls))))


def _schema_keys(cls: type) -> list[str]:
    """`schema_keys` of the union schema `cls`, without the memo."""
    out: list[str] = []

    def walk(node, prefix: str) -> None:
        for name in node:
            key = f"{prefix}.{name}" if prefix else str(name)
            out.append(key)
            child = node._get_node(name)
            if isinstance(child, DictConfig) and not child._is_none() and not isinstance(_schema_default(key), dict):
                walk(child, key)
    walk(OmegaConf.structured(cls), "")
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
    "policy.model_path": ("experiment {experiment} starts RL from a checkpoint: give policy.model_path=<SFT run>/"
                          "checkpoints/global_step_N/hf (or checkpoints/best/hf), or a transformers checkpoint "
                          "directory (README, \"VLA policies\"); policy.model_path=null starts from random weights "
                          "instead"),
}


def to_config(dcfg: DictConfig, *, validate: bool = True, saved: bool = False,
              overrides: Sequence[str] = ()) -> Config:
    """DictConfig (composed, or a saved run config) -> `Config` dataclass whose policy, env and cluster sections are
    the classes their selectors pick (pipelines.families: a key the family lacks is refused, naming the family),
    checked by `tasks.config.check_config` unless `validate=False`. `saved=True`: a run's saved resolved config
    (config.yaml; one of an older format is refused by `pipelines.saved_config`). `overrides`: the command line, whose
    own key names an error below a family key (`+policy.sizes.patch_size=4` with the mlp). Raises ConfigError."""
    from omegaconf.errors import OmegaConfBaseException

    from pipelines.families import selected, set_values, typed_config, unknown_family_key
    from tasks.config import check_config
    plain = OmegaConf.to_container(dcfg, resolve=True)
    plain = set_values(plain)
    classes = selected(plain)  # ConfigError for an unknown family
    try:
        # merging a plain container re-checks every key against the schema (also keys added with `+key=`)
        cfg: Config = typed_config(classes, plain)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        value = OmegaConf.select(dcfg, key) if key else None
        detail = str(exc).splitlines()[0]
        family = unknown_family_key(key, value, classes) if key and "not in" in detail else None
        given = _given_key_under(key, overrides)
        if family is not None and given != key:  # the command line set an entry below the key: name that
            family = ConfigError(given, _value_for(given, overrides), family.fix)
        raise (family or _from_omegaconf(key, value, detail)) from None
    return check_config(cfg) if validate else cfg


COMMAND_LINE = "the command line"


def experiment_name(overrides: Sequence[str] = ()) -> str:
    """The experiment file `conf=NAME` selects (the last one given), else conf/config.yaml's default."""
    for o in reversed(list(overrides)):
        k, _, v = o.lstrip("+").partition("=")
        if k == "conf":
            return v
    defaults = memo.plain_yaml(CONF_DIR / "config.yaml").get("defaults", [])
    return next(d["conf"] for d in defaults if isinstance(d, (dict, DictConfig)) and "conf" in d)


def _leaves(value, prefix: str) -> list[str]:
    """Dotted keys of the leaves of a (nested) dict value under `prefix`; a list or scalar is one leaf."""
    if isinstance(value, (dict, DictConfig)) and len(value):
        return [k for name, v in value.items() for k in _leaves(v, f"{prefix}.{name}" if prefix else str(name))]
    return [prefix]




def _group_choice(entry) -> tuple[str, str | None] | None:
    """(group, choice) of an experiment's defaults-list entry `override /GROUP: NAME`, else None."""
    if not isinstance(entry, (dict, DictConfig)) or len(entry) != 1:
        return None
    (key, choice), = entry.items()
    group = str(key).replace("override", "").strip().lstrip("/")
    return (group, choice) if group in GROUPS else None


def _package(path: Path, default: str) -> str:
    """The package of a conf file: its `# @package NAME` header line ("" for `_global_`: a group file that also
    sets other sections' keys, e.g. conf/algorithm/grpo.yaml's env.auto_reset), else `default` (its group)."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# @package "):
            name = line.split(maxsplit=2)[2].strip()
            return "" if name == "_global_" else name.removeprefix("_global_.")
    return default


def _file_values(path: Path, package: str) -> dict:
    """Dotted key -> value a conf file sets: its own leaves under its package (`package`, "" for `_global_`, unless
    its header says otherwise: `_package`) and, first, those of the files of the same group its defaults list
    includes (`- NAME`, each under its own package); `defaults` itself is not a key. Values as written (a `???`
    stays the string "???")."""
    node = memo.plain_yaml(path)  # plain, unresolved: a `???` value is a key too
    out: dict = {}
    for entry in node.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            out.update(_file_values(path.parent / f"{entry}.yaml", package))
    package = _package(path, package)
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
        for entry in memo.plain_yaml(path).get("defaults", []):
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
# policy.noise_method=flow_sde makes the file's flow_noise std bounds inert, and the other way round) and its family's
# RL update settings (epochs, minibatches, KL stop, log-prob and reward granularity: behaviour cloning reads none of
# them). The same keys set by an experiment file or on the command line are still refused.
GROUP_FILE_DEFAULTS = {
    "conf/env/": ("env.eval", "env.auto_reset", "env.ignore_terminations"),
    "conf/policy/": ("policy.noise_std_min", "policy.noise_std_max", "policy.noise_level", "algorithm.update_epochs",
                     "algorithm.num_minibatches", "algorithm.target_kl", "algorithm.logprob_type",
                     "algorithm.reward_type"),
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


def check_params(cfg: Config) -> None:
    """The config as MLflow params (`storage.tracking.flatten_config`) is valid, so that no run is refused by MLflow
    after its cluster started. Raises ConfigError naming the key.

    Only the param names can be refused (`storage.tracking.param_name`), and they are the config's keys: checked on
    `dataclasses.asdict(cfg)`, which has `to_dict`'s keys (tests/pipelines/test_compose_values.py) at a tenth of
    its cost (no OmegaConf node is built)."""
    import dataclasses

    from storage.tracking import flatten_config
    try:
        flatten_config(dataclasses.asdict(cfg))
    except ValueError as exc:
        raise ConfigError("config", None, f"cannot be logged as MLflow params: {exc}") from None


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
