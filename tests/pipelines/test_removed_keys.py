"""`algorithm.adv_type` was removed (algorithm.name selects the advantage estimator): a user who still sets it gets
an unknown key (tests/pipelines/test_config.py's table); a run's saved config.yaml that has it is of an older
format, refused in one line naming the file and `python -m pipelines.upgrade RUN_DIR`, which drops it once (when
it said what algorithm.name selects); on resume, MLflow params logged with it are not compared
(pipelines.runner `run_params`)."""
import pytest
from omegaconf import OmegaConf

from pipelines.config import load_saved_config, to_yaml
from pipelines.upgrade import main as upgrade_main
from storage.rundir import write_resolved_config
from tasks.config import Config, ConfigError, replace_key, replace_keys


def _saved_before(tmp_path, name: str, adv_type: str):
    """A run's resolved config.yaml as written before the removal: today's keys plus algorithm.adv_type."""
    cfg = replace_key(Config(), "algorithm.name", name)
    if name == "grpo":
        cfg = replace_keys(cfg, {"algorithm.group_size": 2, "env.auto_reset": False})
    d = OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))
    d["algorithm"]["adv_type"] = adv_type
    write_resolved_config(tmp_path, OmegaConf.to_yaml(OmegaConf.create(d)))
    return tmp_path / "config.yaml"


@pytest.mark.parametrize("name, adv_type", [("ppo", "gae"), ("grpo", "grpo"), ("sft", "gae")])
def test_a_saved_config_with_adv_type_is_refused_then_loads_once_upgraded(tmp_path, name, adv_type):
    path = _saved_before(tmp_path, name, adv_type)
    with pytest.raises(ConfigError) as exc:
        load_saved_config(path, validate=False)
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg and f"`python -m pipelines.upgrade {tmp_path}`" in msg
    assert upgrade_main([str(tmp_path)]) == 0
    cfg = load_saved_config(path, validate=False)
    assert cfg.algorithm.name == name and not hasattr(cfg.algorithm, "adv_type")


def test_a_saved_config_contradicting_its_name_is_not_upgraded(tmp_path, capsys):
    path = _saved_before(tmp_path, "ppo", "grpo")
    before = path.read_text()
    assert upgrade_main([str(tmp_path)]) == 2
    assert "algorithm.adv_type='grpo' but algorithm.name=ppo uses gae" in capsys.readouterr().err
    assert path.read_text() == before


def test_resume_of_a_run_whose_params_have_adv_type(tmp_path):
    """MLflow params of a run logged before the removal hold algorithm.adv_type; the resumed config has no such key,
    so it is not compared (the run resumes), while a key that shapes training still must match."""
    from mlflow.tracking import MlflowClient
    from pipelines.config import to_dict
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
    cfg = replace_key(cfg, "algorithm.gamma", 0.5)
    with pytest.raises(ConfigError, match=r"algorithm.gamma='0.5': differs from the resumed run \('0.8'\)"):
        run_params(cfg, run.info.run_id, uri)
