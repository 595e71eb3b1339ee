"""Command-line values of string keys are kept exactly as typed: Hydra's grammar reads `2026_12` as
the integer 202612, `1e3` as 1000.0, `true` as True, and the structured config then held "202612", "1000.0", "True"
(a run directory and MLflow experiment the user did not name). `pipelines.config.as_typed` hands such values to Hydra
quoted; number keys keep Hydra's reading; `null` stays None for an Optional string and is refused for another."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from pipelines.config import as_typed, load_config, load_saved_config, to_yaml
from storage.rundir import write_resolved_config
from tasks.config import ConfigError, config_value


@pytest.fixture(autouse=True)
def _cpu_only_machine(monkeypatch):
    import pipelines.clusters.placement
    monkeypatch.setattr(pipelines.clusters.placement, "_cuda_device_count", lambda: 0)


# string keys: the value held is the text after `=`, whatever Hydra's grammar would make of it
STRING_CASES = ["experiment=2026_12", "experiment=1e3", "experiment=true", "experiment=TRUE", "experiment=+5",
                "experiment=inf", "experiment=-nan", "experiment=1.50", "experiment=0", "experiment=0x10",
                "run_root=2026_12", "tracking.experiment=1_0", "runner.resume=20261206-083225-c63f",
                "runner.resume=20261206", "runner.resume=1e3", "cluster.component_placement.actor=0"]


@pytest.mark.parametrize("override", STRING_CASES)
def test_a_string_key_holds_exactly_what_was_typed(override):
    key, _, typed = override.partition("=")
    cfg, dcfg = load_config(["conf=smoke", override], components=False)
    assert config_value(cfg, key) == typed and isinstance(config_value(cfg, key), str)
    assert OmegaConf.select(dcfg, key) == typed  # the resolved DictConfig (saved, logged) too


def test_quoted_forms_still_work_and_numbers_keep_hydras_reading():
    cfg, _ = load_config(["conf=smoke", "experiment='2026_12'", "runner.max_steps=1_000", "algorithm.gamma=9.9e-1",
                          "policy.model_path=null"], components=False)
    assert cfg.experiment == "2026_12"
    assert cfg.runner.max_steps == 1000 and cfg.algorithm.gamma == 0.99  # what the user meant
    assert cfg.policy.model_path is None  # null is None for an Optional string (documented: random weights)


def test_as_typed_quotes_only_string_keys_read_as_other_types():
    given = ["experiment=2026_12", "+experiment=true", "runner.max_steps=1_000", "runner.resume=abc-1",
             "policy.model_path=null", "conf=smoke", "env=1e3"]
    assert as_typed(given) == ["experiment='2026_12'", "+experiment='true'", "runner.max_steps=1_000",
                               "runner.resume=abc-1", "policy.model_path=null", "conf=smoke", "env='1e3'"]


def test_a_typed_string_survives_the_saved_config(tmp_path):
    """config.yaml (resume, replay, eval) reads the string back, not the number YAML would make of it."""
    cfg, _ = load_config(["conf=smoke", "experiment=2026_12", "tracking.experiment=true"], components=False)
    write_resolved_config(tmp_path, to_yaml(cfg))
    back = load_saved_config(tmp_path / "config.yaml", validate=False)
    assert back.experiment == "2026_12" and back.tracking.experiment == "true"


@pytest.mark.parametrize("override, key, fix", [
    ("experiment=null", "experiment", "experiment=\"'null'\""),
    ("run_root=null", "run_root", "run_root=\"'null'\""),
    ("cluster.component_placement={actor: true}", "cluster.component_placement.actor", "actor: 'VALUE'"),
    ("cluster.component_placement={actor: 1e3}", "cluster.component_placement.actor", "actor: 'VALUE'"),
    ("cluster.component_placement={actor: 1_0}", "cluster.component_placement.actor", "actor: 'VALUE'"),
])
def test_a_value_that_cannot_be_kept_is_refused_with_the_quoting(override, key, fix):
    with pytest.raises(ConfigError) as info:
        load_config(["conf=smoke", override], components=False)
    assert info.value.key == key and fix in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_dict_entry_written_as_python_prints_it_is_kept():
    cfg, _ = load_config(["conf=smoke", "cluster.component_placement={actor: 0, env: all}"], components=False)
    assert cfg.cluster.component_placement["actor"] == "0"


def test_a_conf_name_that_looks_like_a_number_is_looked_up_as_typed():
    with pytest.raises(ConfigError) as info:  # was a raw ValueError ("must be a string or a list. Got int")
        load_config(["conf=2026_12"], components=False)
    assert info.value.key == "conf" and "conf/conf/2026_12.yaml" in info.value.fix


def test_the_cli_refusal_is_one_line(capsys):
    from pipelines.cli import load
    assert load(["conf=smoke", "experiment=null"], components=False) is None
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: experiment='null'"), err


def test_the_eval_of_a_run_keeps_typed_strings(tmp_path):
    """pipelines.eval merges its overrides into the run's config.yaml (not through Hydra's compose)."""
    from pipelines.eval import Source, eval_config
    cfg, _ = load_config(["conf=smoke"], components=False)
    write_resolved_config(tmp_path, to_yaml(cfg))
    out = eval_config(Source("run", run_dir=tmp_path), ["run_root=2026_12", "tracking.experiment=1e3"])
    assert out.run_root == "2026_12" and out.tracking.experiment == "1e3"
