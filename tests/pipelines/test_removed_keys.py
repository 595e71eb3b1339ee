"""`algorithm.adv_type` was removed (algorithm.name selects the advantage estimator): a user who still sets it gets
the fix (tests/pipelines/test_config.py's table), while what older runs saved still loads: their config.yaml (the
teacher config of pipelines.record) and, on resume, their MLflow params (pipelines.runner `run_params`)."""
import pytest
from omegaconf import OmegaConf

from pipelines.config import to_config, to_dict, to_yaml
from tasks.config import Config, ConfigError


def _saved_before(tmp_path, name: str, adv_type: str):
    """A run's resolved config.yaml as written before the removal: today's keys plus algorithm.adv_type."""
    cfg = Config()
    cfg.algorithm.name = name
    if name == "grpo":
        cfg.algorithm.group_size, cfg.env.auto_reset = 2, False
    d = OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))
    d["algorithm"]["adv_type"] = adv_type
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(d)))
    return path


@pytest.mark.parametrize("name, adv_type", [("ppo", "gae"), ("grpo", "grpo"), ("sft", "gae")])
def test_a_saved_config_with_the_adv_type_it_implied_loads(tmp_path, name, adv_type):
    cfg = to_config(OmegaConf.load(_saved_before(tmp_path, name, adv_type)), saved=True, validate=False)
    assert cfg.algorithm.name == name and not hasattr(cfg.algorithm, "adv_type")


def test_a_saved_config_contradicting_its_name_and_a_composed_one_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.adv_type='grpo': the saved config's algorithm.name=ppo uses gae"):
        to_config(OmegaConf.load(_saved_before(tmp_path, "ppo", "grpo")), saved=True, validate=False)
    with pytest.raises(ConfigError, match=r"algorithm.adv_type='gae': was removed: algorithm.name selects"):
        to_config(OmegaConf.load(_saved_before(tmp_path, "ppo", "gae")), validate=False)  # not a saved config


def test_resume_of_a_run_whose_params_have_adv_type(tmp_path):
    """MLflow params of a run logged before the removal hold algorithm.adv_type; the resumed config has no such key,
    so it is not compared (the run resumes), while a key that shapes training still must match."""
    from mlflow.tracking import MlflowClient
    from pipelines.runner import run_params
    from storage.tracking import flatten_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("old"))
    cfg = Config()
    old = {**flatten_config(to_dict(cfg)), "algorithm.adv_type": "gae"}
    for k, v in old.items():
        client.log_param(run.info.run_id, k, v)
    params, changed = run_params(cfg, run.info.run_id, uri)
    assert "algorithm.adv_type" not in params and changed == {}
    cfg.algorithm.gamma = 0.5
    with pytest.raises(ConfigError, match=r"algorithm.gamma='0.5': differs from the resumed run \('0.8'\)"):
        run_params(cfg, run.info.run_id, uri)
