"""The offline checks of a config's components (pipelines/components.py, through pipelines.config.load_config):
a checkpoint of another policy family is refused naming the family's policy preset to choose; a cluster-wide
`cluster.gpu_memory_gib` the policy has no memory plan for is said in a note."""
from __future__ import annotations

import json

import pytest

from pipelines.config import load_config
from tasks.config import ConfigError


def _checkpoint(path, **meta):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(meta))
    return str(path)


@pytest.mark.parametrize("given, saved, meta", [
    ("pi05", "pi0", {"family": "pi0", "model_type": "pi0", "policy": {"preset": "tiny"}}),  # a dagrl export
    ("pi0", "pi05", {"model_type": "pi05"}),  # a plain transformers directory
])
def test_a_checkpoint_of_the_other_pi_family_names_its_policy(tmp_path, given, saved, meta):
    path = _checkpoint(tmp_path / "ckpt", **meta)
    base = ["conf=smoke", "env=pushcube_vla", f"policy={given}_tiny", f"policy.model_path={path}"]
    with pytest.raises(ConfigError) as e:
        load_config(base)
    msg = str(e.value)
    assert e.value.key == "policy.model_path" and "\n" not in msg
    assert f"policy={saved}_tiny" in msg and f"policy.name={given}" in msg
    if "family" in meta:  # the export's own preset comes first
        assert msg.index(f"policy={saved}_tiny") < msg.index(f"policy={saved}_base")


def test_a_checkpoint_of_a_model_no_family_reads_says_so(tmp_path):
    path = _checkpoint(tmp_path / "ckpt", model_type="llama")
    with pytest.raises(ConfigError, match=r"model_type='llama' model, which no policy family reads"):
        load_config(["conf=smoke", "env=pushcube_vla", "policy=pi0_tiny", f"policy.model_path={path}"])


def test_gpu_memory_gib_is_a_note_for_a_family_without_a_memory_plan():
    notes: list[str] = []
    load_config(["conf=smoke", "cluster.gpu_memory_gib=80"], notes=notes, components=False)
    assert [n for n in notes if "gpu_memory_gib" in n] == [
        "note: cluster.gpu_memory_gib=80.0 is not checked for policy.name=mlp: that family has no offline memory plan "
        "(the families with one: pi0, pi05)"]
    notes.clear()
    load_config(["conf=smoke", "env=pushcube_vla", "policy=pi0_tiny", "cluster.gpu_memory_gib=80"], notes=notes,
                components=False)
    assert not [n for n in notes if "gpu_memory_gib" in n]
