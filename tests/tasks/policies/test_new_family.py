"""Adding a policy family is local: a throwaway family written by this test (a folder with its config, model and
rule), its conf file and one registry line train through `conf=smoke`-sized settings, with no other edit.

The folder lives in a temporary directory on sys.path (and on the workers' PYTHONPATH); the conf file joins a copy
of the project's conf/ tree; the registry line is the family's entry in `tasks.config.registry.MODULES`."""
from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

FOLDER = {
    "__init__.py": "",
    "configuration.py": '''
        """The toy family's config: a linear Gaussian policy on the state vector."""
        from dataclasses import dataclass
        from typing import ClassVar

        from tasks.config.registry import register_family
        from tasks.config.schema import PolicyConfig
        from toyfam.checks import CHECKS


        @register_family("policy", "toy", checks=CHECKS)
        @dataclass(frozen=True)
        class ToyConfig(PolicyConfig):
            name: str = "toy"
            init_std: float = 0.3  # the actions' fixed standard deviation
            model: ClassVar[str] = "toyfam.model:ToyPolicy"
            images: ClassVar[bool] = False
        ''',
    "checks.py": '''
        from tasks.config.errors import ConfigError


        def check_std(cfg) -> None:
            if not cfg.policy.init_std > 0:
                raise ConfigError("policy.init_std", cfg.policy.init_std, "use a standard deviation > 0")


        CHECKS = (check_std,)
        ''',
    "model.py": '''
        import math

        import torch
        from torch import nn
        from torch.distributions import Normal


        class ToyPolicy(nn.Module):
            needs_prompt = False

            def __init__(self, cfg, obs_dim, action_dim, num_values=1):
                super().__init__()
                self.C, self.D, self.num_values = cfg.num_action_chunks, action_dim, num_values
                self.mean = nn.Linear(obs_dim, self.C * self.D)
                self.value = nn.Linear(obs_dim, num_values)
                self.log_std = nn.Parameter(torch.full((self.C * self.D,), math.log(cfg.init_std)))

            def _dist(self, state):
                mean = self.mean(state).view(-1, self.C, self.D)
                return Normal(mean, self.log_std.exp().view(self.C, self.D).expand_as(mean))

            def values(self, obs):
                v = self.value(obs["state"])
                return v.squeeze(-1) if self.num_values == 1 else v

            @torch.no_grad()
            def act(self, obs, deterministic=False):
                dist = self._dist(obs["state"])
                actions = dist.mean if deterministic else dist.sample()
                return {"actions": actions, "logprobs": dist.log_prob(actions), "values": self.values(obs),
                        "extras": {}}

            def evaluate(self, obs, actions, extras=None):
                dist = self._dist(obs["state"])
                return {"logprobs": dist.log_prob(actions), "entropy": dist.entropy(), "values": self.values(obs)}
        ''',
}
CONF = "# @package _global_\npolicy:\n  name: toy\n  init_std: 0.4\n"


@pytest.fixture
def toy_family(tmp_path, monkeypatch):
    """The family's folder on sys.path and PYTHONPATH, its conf file in a copy of conf/, its registry line."""
    from tasks.config import registry
    import pipelines.compose as compose
    src = tmp_path / "src"
    (src / "toyfam").mkdir(parents=True)
    for name, text in FOLDER.items():
        (src / "toyfam" / name).write_text(textwrap.dedent(text))
    conf = tmp_path / "conf"
    shutil.copytree(compose.CONF_DIR, conf)
    (conf / "policy" / "toy.yaml").write_text(CONF)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setenv("PYTHONPATH", f"{src}:{ROOT}")
    monkeypatch.setattr(compose, "CONF_DIR", conf)
    monkeypatch.setitem(registry.MODULES["policy"], "toy", "toyfam.configuration")  # the one registry line
    yield tmp_path
    for mod in [m for m in sys.modules if m == "toyfam" or m.startswith("toyfam.")]:
        del sys.modules[mod]
    registry._CLASSES["policy"].pop("toy", None)
    registry._CHECKS["policy"].pop("toy", None)


def test_the_new_family_composes_checks_and_refuses_keys_it_lacks(toy_family):
    from pipelines.config import load_config
    from tasks.config import ConfigError
    cfg, _ = load_config(["conf=smoke", "policy=toy"], components=False)
    assert type(cfg.policy).__name__ == "ToyConfig" and cfg.policy.init_std == 0.4
    with pytest.raises(ConfigError) as bad:  # the folder's own rule, run by the one check path
        load_config(["conf=smoke", "policy=toy", "policy.init_std=0"], components=False)
    assert bad.value.key == "policy.init_std"
    with pytest.raises(ConfigError) as unknown:  # the mlp's key is not the toy family's
        load_config(["conf=smoke", "policy=toy", "policy.hidden_sizes=[8]"], components=False)
    assert "hidden_sizes" in str(unknown.value) and "toy" in str(unknown.value)


@pytest.mark.cluster
def test_the_new_family_trains_through_smoke_settings(toy_family):
    import torch

    from pipelines.run import main
    from storage.checkpoints import load_checkpoint
    root = toy_family / "runs"
    assert main(["conf=smoke", "policy=toy", f"run_root={root}", "runner.max_steps=2", "runner.save_interval=2",
                 "runner.val_check_interval=2"]) == 0
    run_dir = next((root / "smoke").iterdir())
    ckpt = run_dir / "checkpoints" / "global_step_2"
    assert ckpt.is_dir() and (run_dir / "evals" / "step_2.json").is_file()
    state = load_checkpoint(ckpt)
    weights = state["policy"] if "policy" in state else state
    assert {"mean.weight", "value.weight", "log_std"} <= set(weights)
    # the updates trained the toy's parameters: its log-std left the conf file's log(0.4)
    import math
    assert not torch.allclose(weights["log_std"], torch.full_like(weights["log_std"], math.log(0.4)))
