"""The command line's list and dict values (pipelines/overrides.py): a scalar given for a list key is refused in one
line naming the key and the bracketed form (not OmegaConf's type message), for every list key of the schema; `{}`
for a dict key empties the experiment's entries (Hydra alone would merge it into them)."""
from __future__ import annotations

import pytest
from omegaconf import ListConfig

from pipelines.config import as_typed, load_config
from tasks.config import ConfigError


def _list_keys() -> list[str]:
    from pipelines.compose import schema_keys
    from pipelines.overrides import _slot
    return [k for k in schema_keys() if isinstance(_slot(k, family_keys=True), ListConfig)]


def test_the_schema_has_list_keys_of_several_sections():
    keys = _list_keys()
    assert {"policy.freeze", "policy.lora_targets", "runner.profile_steps"} <= set(keys)


@pytest.mark.parametrize("key", _list_keys())
def test_a_scalar_for_any_list_key_names_the_key_and_the_bracketed_form(key):
    with pytest.raises(ConfigError) as e:
        as_typed([f"{key}=abc"])
    assert e.value.key == key and f"{key}=[abc]" in str(e.value) and "\n" not in str(e.value)
    as_typed([f"{key}=[abc]"])  # the bracketed form parses


def test_policy_freeze_without_brackets_is_refused_and_the_fix_loads():
    base = ["conf=smoke", "env=pushcube_vla", "policy=pi0_tiny"]
    with pytest.raises(ConfigError) as e:
        load_config([*base, "policy.freeze=hf.model.vlm"], components=False)
    assert str(e.value) == ("policy.freeze='hf.model.vlm': is a list: write its entries in brackets, "
                            "policy.freeze=[hf.model.vlm] (several: policy.freeze=[a,b])")
    cfg, _ = load_config([*base, "policy.freeze=[hf.model.vlm]"], components=False)
    assert list(cfg.policy.freeze) == ["hf.model.vlm"]
    with pytest.raises(ConfigError, match=r"policy.freeze='null': is a list and cannot be null: .*policy.freeze=\[\]"):
        load_config([*base, "policy.freeze=null"], components=False)


def test_empty_braces_clear_a_dict_key_of_the_experiment():
    """`cluster.component_placement={}` after an experiment that places components: the entries are gone (the
    schema's defaults: actor with rollout on device 0), where Hydra's merge would have kept them."""
    place = ["conf=smoke", "+cluster.component_placement={actor: '0', env: '0', rollout: '0'}"]
    cfg, _ = load_config(place, components=False)
    assert cfg.cluster.component_placement["actor"] == "0"
    cfg, _ = load_config([*place, "cluster.component_placement={}"], components=False)
    assert dict(cfg.cluster.component_placement) == {"actor": "", "env": "", "rollout": ""}
