"""conf=libero_pi0_grpo (GRPO of a pi0 / pi0.5 checkpoint on LIBERO), offline: composed and validated with a tiny
random checkpoint written by transformers alone (LIBERO's 8-D state and 7-D actions, as tests/pipelines/
test_libero_pi0.py makes one), no simulator, no cluster. What GRPO needs of the env is derived from the config
itself: groups that share a reset state and never straddle env shards, one whole episode per env and rollout
(auto_reset off, chunk_steps x C = the suite's horizon), every env kept on one task (groups a multiple of the
suite's tasks), and the inputs of conf=libero_pi0_ppo (two cameras, their size, the settle steps)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

PROMPT = {"pi0": 128, "pi05": 256}  # the tiny byte-level tokenizer's prompt lengths (test_libero_pi0.py)


def _tiny_checkpoint(family: str, d) -> None:
    """A tiny random pi0 / pi05 directory as plain transformers writes it (config.json, model.safetensors, the
    processor's files with LIBERO-sized normalisation statistics)."""
    import torch

    from tasks.policies.pi0.library import model_class, preset_config
    from tasks.policies.pi0.processor import new_processor
    probe = preset_config(family, "tiny", chunk_size=10, num_steps=4)
    pad = getattr(probe, "max_state_dim", None) or probe.max_action_dim
    proc = new_processor(family, image_size=32, patch_size=8, obs_dim=8, action_dim=7, max_state_dim=pad,
                         chunk_size=10)
    torch.manual_seed(0)
    lib = model_class(family)(preset_config(family, "tiny", chunk_size=10, num_steps=4,
                                            vocab_size=len(proc.tokenizer), image_token_id=proc.image_token_id))
    lib.save_pretrained(str(d))
    proc.save_pretrained(str(d))
    assert json.loads((d / "config.json").read_text())["model_type"] == family


@pytest.mark.parametrize("family", ["pi0", "pi05"])
def test_libero_pi0_grpo_composes_and_validates_with_a_tiny_checkpoint(family, tmp_path, capsys):
    from pipelines import validate
    from pipelines.config import load_config
    from tasks.envs import instructions, max_episode_steps, num_cameras
    from tasks.envs.libero.checks import check_run
    from tasks.policies import make_policy
    from tasks.rollout import group_size, image_size, num_values
    d = tmp_path / f"{family}_libero"
    _tiny_checkpoint(family, d)
    capsys.readouterr()  # what writing it printed
    words = ["conf=libero_pi0_grpo", f"policy.model_path={d}", "policy.device=cpu", "policy.dtype=float32",
             f"policy.max_prompt_len={PROMPT[family]}", f"run_root={tmp_path / 'runs'}"]
    if family == "pi05":
        words.insert(1, "policy=pi05_base")
    assert validate.main(words) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    assert out.out.startswith("ok: ") and out.err == ""  # no note, no warning (e.g. envs moving between tasks)
    cfg, _ = load_config(words)
    e, a, r = cfg.env, cfg.algorithm, cfg.rollout
    assert cfg.experiment == "libero_pi0_grpo" and cfg.policy.name == family and cfg.policy.model_path == str(d)
    assert a.name == "grpo" and not a.spec.critic and num_values(cfg) == 1
    # groups: G envs share a reset state; a shard holds whole groups; one group per task and step, each env on
    # one task (check_run's warnings are the rebuilds)
    G, tasks = group_size(cfg), len(instructions(e))
    assert G == a.group_size > 1 and e.shard_size % G == 0
    assert (e.num_envs // G) % tasks == 0 and check_run(e.num_envs, G, tasks, e.eval.num_envs) == []
    # one whole episode per env and rollout: new episodes at every rollout, as long as the suite's horizon
    assert not e.auto_reset and r.chunk_steps * cfg.policy.num_action_chunks == max_episode_steps(e)
    # the inputs of the PPO conf for the same checkpoint
    ppo, _ = load_config(["conf=libero_pi0_ppo", *words[1:]], components=False)
    for key in ("env_id", "wrist_camera", "image_size", "num_steps_wait", "obs_mode", "control_mode"):
        assert getattr(e, key) == getattr(ppo.env, key), key
    assert num_cameras(e) == 2 and type(cfg.policy).cameras == 2
    # the directory is the model: it builds (its tiny sizes, not the base preset's), with its 7-D actions
    pol = make_policy(cfg.policy, obs_dim=8, action_dim=7, num_values=num_values(cfg), image_size=image_size(cfg))
    assert pol.hf.config.chunk_size == 10 and sum(p.numel() for p in pol.parameters()) < 1e6
