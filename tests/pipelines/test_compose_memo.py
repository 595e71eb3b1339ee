"""`pipelines.compose`'s memo (pipelines.compose_memo) (README "Tests": the unit tier composes the same configs hundreds of times): a
memoised composition equals Hydra's own, every caller gets its own copy, and whatever a composition reads (a conf
file's bytes, the directory) is part of the key, so an edit is seen by the very next call."""
from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from pipelines import compose as pc
from pipelines import compose_memo as memo


@pytest.mark.parametrize("overrides", [[], ["conf=smoke"], ["conf=smoke", "runner.max_steps=7"],
                                       ["env=pushcube", "algorithm=grpo"]])
def test_a_memoised_composition_equals_hydras(overrides):
    first = pc.compose(overrides)  # composed (or already memoised by an earlier test)
    again = pc.compose(overrides)  # memoised
    fresh = pc._compose(overrides)  # Hydra, no memo
    want = OmegaConf.to_container(fresh)
    assert OmegaConf.to_container(first) == want and OmegaConf.to_container(again) == want
    assert OmegaConf.is_struct(again) == OmegaConf.is_struct(fresh)
    assert OmegaConf.to_yaml(again) == OmegaConf.to_yaml(fresh)


def test_each_call_gets_its_own_copy(monkeypatch):
    a = pc.compose(["conf=smoke"])
    max_steps = a.runner.max_steps
    a.runner.max_steps = max_steps + 100  # a caller's edit
    monkeypatch.setattr(pc, "_compose", lambda overrides: pytest.fail(f"composed again: {overrides}"))
    b = pc.compose(["conf=smoke"])  # from the memo (Hydra not called), without the edit
    assert b is not a and b.runner.max_steps == max_steps
    cfg1, cfg2 = pc.to_config(pc.compose(["conf=smoke"])), pc.to_config(pc.compose(["conf=smoke"]))
    assert cfg1 == cfg2 and cfg1 is not cfg2 and cfg1.runner is not cfg2.runner
    with pytest.raises(pytest.fail.Exception, match="composed again"):  # another key is not in the memo
        pc.compose(["conf=smoke", "runner.max_steps=12345"])


def test_an_edited_conf_file_is_read_at_the_next_compose(tmp_path, monkeypatch):
    """Same size, same second: the key is the files' bytes, not their modification times."""
    conf = tmp_path / "conf"
    shutil.copytree(pc.CONF_DIR, conf)
    monkeypatch.setattr(pc, "CONF_DIR", conf)
    exp = conf / "conf" / "smoke.yaml"
    seed = pc.compose(["conf=smoke"]).seed
    assert 0 <= seed < 9
    text = exp.read_text()
    edited = text.replace(f"\nseed: {seed}\n", f"\nseed: {seed + 1}\n")
    assert edited != text and len(edited) == len(text)
    exp.write_text(edited)
    assert pc.compose(["conf=smoke"]).seed == seed + 1
    assert pc.given_keys(["conf=smoke"])["seed"] == "conf/conf/smoke.yaml"
    (conf / "conf" / "smoke_copy.yaml").write_text(edited)  # a new file: a new key, and the file is found
    assert pc.compose(["conf=smoke_copy"]).seed == seed + 1
    exp.unlink()  # a removed file: refused as Hydra refuses it, not served from the memo
    with pytest.raises(pc.ConfigError, match="no conf/conf/smoke.yaml"):
        pc.compose(["conf=smoke"])


def test_conf_file_reads_are_copies():
    path = pc.CONF_DIR / "config.yaml"
    first = memo.plain_yaml(path)
    first["defaults"].append("not in the file")
    assert memo.plain_yaml(path) == OmegaConf.to_container(OmegaConf.load(path))


def test_clear_forgets_every_composition(monkeypatch):
    pc.compose(["conf=smoke"])
    memo.clear()
    calls = []
    real = pc._compose
    monkeypatch.setattr(pc, "_compose", lambda overrides: calls.append(list(overrides)) or real(overrides))
    pc.compose(["conf=smoke"])
    pc.compose(["conf=smoke"])
    assert calls == [["conf=smoke"]]  # composed once after clear(), then kept


def test_the_schema_is_stored_again_when_its_store_entry_was_replaced():
    from hydra.core.config_store import ConfigStore
    store = ConfigStore.instance()
    pc.register_schema()
    node = store.repo[f"{pc.SCHEMA_NAME}.yaml"]
    pc.register_schema()  # unchanged: not stored again
    assert store.repo[f"{pc.SCHEMA_NAME}.yaml"] is node
    store.store(name=pc.SCHEMA_NAME, node={"replaced": 1})
    pc.register_schema()
    assert store.repo[f"{pc.SCHEMA_NAME}.yaml"] is not node
    assert "runner" in store.repo[f"{pc.SCHEMA_NAME}.yaml"].node
