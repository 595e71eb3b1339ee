"""Compose the Hydra config for `conf=NAME key=value ...`, map it onto `tasks.config.Config`, validate once.

Everything a user can get wrong in a config surfaces here, before any worker starts, as `ConfigError` with one
line naming the key, the value and the fix: unknown keys and wrong types (from the structured schema), impossible
combinations (`Config.validate`), an env task the simulator does not have or that needs downloads, a missing
Vulkan driver for ManiSkill.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf

from tasks.config import Config, ConfigError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SCHEMA_NAME = "dagrl_schema"


def register_schema() -> None:
    """Register `Config` in Hydra's ConfigStore as `dagrl_schema` (the first entry of conf/config.yaml's defaults)."""
    from hydra.core.config_store import ConfigStore
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose conf/config.yaml with command-line overrides (`conf=NAME`, `a.b=value`, `+new=...`).

    Raises:
        ConfigError: unknown key, wrong type, unknown `conf` name, or an override Hydra cannot parse.
    """
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise _config_error(exc, overrides) from None


def _config_error(exc: Exception, overrides: Sequence[str]) -> ConfigError:
    msg = " ".join(str(exc).split())
    if "in group conf" in msg or "Could not find 'conf/" in msg:
        names = sorted(p.stem for p in (CONF_DIR / "conf").glob("*.yaml"))
        given = next((o.split("=", 1)[1] for o in overrides if o.startswith("conf=")), "?")
        return ConfigError("conf", given, f"no conf/conf/{given}.yaml; available: {names}")
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None) or getattr(exc, "full_key", None)
    detail = str(cause).splitlines()[0]
    return _from_omegaconf(key, _value_for(key, overrides), detail)


def _from_omegaconf(key, value, detail: str) -> ConfigError:
    if "not in" in detail or "Could not override" in detail:
        return ConfigError(key or "config", value,
                           "unknown key (a typo?); `python -m pipelines.validate --show` prints every key")
    if "could not be converted" in detail or "is not a valid" in detail or "Unsupported value type" in detail:
        return ConfigError(key or "config", value, f"wrong type: {detail}")
    return ConfigError(key or "config", value, detail[:300])


def _value_for(key, overrides: Sequence[str]):
    for o in overrides:
        k, _, v = o.lstrip("+~").partition("=")
        if key and k == key:
            return v
    return None


def to_config(dcfg: DictConfig) -> Config:
    """DictConfig (already typed by the schema) -> validated `Config` dataclass. Raises ConfigError."""
    from omegaconf.errors import OmegaConfBaseException
    try:
        # merging a plain container re-checks every key against the schema (also keys added with `+key=`)
        typed = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(dcfg, resolve=True))
        cfg: Config = OmegaConf.to_object(typed)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        raise _from_omegaconf(key, OmegaConf.select(dcfg, key) if key else None, str(exc).splitlines()[0]) from None
    return cfg.validate()


def check_components(cfg: Config) -> None:
    """Validation that needs the component registries: policy name, simulator, env task, Vulkan.

    Raises:
        ConfigError, tasks.envs.vulkan.VulkanMissingError.
    """
    from tasks.envs import check_env_config
    from tasks.policies import check_policy_config
    from tasks.algorithms import advantage_names
    sizes = check_policy_config(cfg.policy)
    if sizes and cfg.env.obs_mode == "rgb" and cfg.env.image_size % sizes.get("patch_size", 1):
        raise ConfigError("env.image_size", cfg.env.image_size,
                          f"must be a multiple of the {cfg.policy.preset} preset's patch_size={sizes['patch_size']} "
                          f"(or override policy.sizes.patch_size)")
    if cfg.algorithm.adv_type not in (*advantage_names(), "grpo"):  # grpo: tasks.algorithms.grpo_advantages
        raise ConfigError("algorithm.adv_type", cfg.algorithm.adv_type,
                          f"known estimators: {[*advantage_names(), 'grpo']}")
    check_env_config(cfg.env)
    if cfg.policy.model_path:
        check_model_path(cfg)
    if cfg.algorithm.name == "sft":
        check_sft_store(cfg)
    if cfg.env.eval.num_envs % cfg.env.num_shards:
        raise ConfigError("env.eval.num_envs", cfg.env.eval.num_envs,
                          f"must be divisible by env.num_shards={cfg.env.num_shards} (eval envs are sharded the same way)")
    if cfg.env.simulator == "maniskill":
        from tasks.envs.vulkan import vulkan_env
        vulkan_env()


def check_model_path(cfg: Config) -> None:
    """policy.model_path's config.json against the config: family, image size, chunk length. Raises ConfigError."""
    import json
    import os
    meta = json.loads(open(os.path.join(cfg.policy.model_path, "config.json")).read())
    p, key = cfg.policy, "policy.model_path"
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


def check_sft_store(cfg: Config) -> None:
    """sft.store against the config: chunk length, images, and at least one selectable chunk step."""
    from storage.trajectories import TrajectoryStore
    from tasks.demos import sft_index
    st = TrajectoryStore.open(cfg.sft.store)
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
    try:
        sft_index(cfg.sft.store, cfg.sft.only_success)
    except ValueError as exc:
        raise ConfigError("sft.store", cfg.sft.store, f"{str(exc).split(': ', 1)[-1]}; record more episodes or set "
                                                      f"sft.only_success=false") from None


def load_config(overrides: Sequence[str] = (), *, components: bool = True) -> tuple[Config, DictConfig]:
    """Compose, type, validate. Returns (Config, the resolved DictConfig for saving/logging)."""
    dcfg = compose(overrides)
    cfg = to_config(dcfg)
    if components:
        check_components(cfg)
    return cfg, dcfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
