"""storage.checkpoints: the best pointer (best.json + the `best` link), pruning that never removes it, and
sync_best after a resume / rollback. Tiny checkpoints, no cluster, ~1 s."""
import json
import os

import pytest

from storage.checkpoints import (BEST_FILE, BEST_LINK, best_checkpoint, checkpoint_dir, clear_best,
                                 latest_checkpoint, list_checkpoints, mark_best, prune_checkpoints, read_best,
                                 save_checkpoint, sync_best)


def _save(run_dir, step):
    return save_checkpoint(run_dir, step, {"run": {"step": step}})


def _steps(run_dir):
    return [int(p.name.rsplit("_", 1)[1]) for p in list_checkpoints(run_dir)]


def test_mark_best_writes_pointer_and_link(tmp_path):
    _save(tmp_path, 4)
    path = mark_best(tmp_path, 4, 0.625)
    assert path == checkpoint_dir(tmp_path, 4) == best_checkpoint(tmp_path)
    rec = json.loads((tmp_path / "checkpoints" / BEST_FILE).read_text())
    assert rec["step"] == 4 and rec["checkpoint"] == "global_step_4" and rec["value"] == 0.625
    link = tmp_path / "checkpoints" / BEST_LINK
    assert link.is_symlink() and os.readlink(link) == "global_step_4"  # relative: survives moving the run dir
    assert (link / "index.json").is_file()
    # no temp files left behind; the link is not mistaken for a checkpoint
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [BEST_LINK, BEST_FILE, "global_step_4"]
    assert _steps(tmp_path) == [4] and latest_checkpoint(tmp_path).name == "global_step_4"
    # re-pointing replaces both
    _save(tmp_path, 8)
    mark_best(tmp_path, 8, 0.7)
    assert read_best(tmp_path)["step"] == 8 and os.readlink(link) == "global_step_8"


def test_mark_best_refuses_a_missing_checkpoint(tmp_path):
    _save(tmp_path, 2)
    mark_best(tmp_path, 2, 0.5)
    with pytest.raises(ValueError, match="step 3"):
        mark_best(tmp_path, 3, 0.9)
    assert read_best(tmp_path)["step"] == 2  # unchanged


@pytest.mark.parametrize("keep", [0, 1, 2, 3])
def test_prune_never_removes_the_best(tmp_path, keep):
    steps = [0, 4, 8, 12, 16]
    for best in (4, 0, 16, 12):
        for s in steps:
            if not checkpoint_dir(tmp_path, s).exists():
                _save(tmp_path, s)
        mark_best(tmp_path, best, 0.5)
        removed = prune_checkpoints(tmp_path, keep)
        expected = sorted(set(steps[len(steps) - keep:] if keep else []) | {best})
        assert _steps(tmp_path) == expected, (best, keep)
        assert best_checkpoint(tmp_path).name == f"global_step_{best}"
        assert sorted(int(p.name.rsplit("_", 1)[1]) for p in removed) == [s for s in steps if s not in expected]
    # without a pointer pruning keeps exactly the newest `keep`
    clear_best(tmp_path)
    for s in steps:
        if not checkpoint_dir(tmp_path, s).exists():
            _save(tmp_path, s)
    prune_checkpoints(tmp_path, keep)
    assert _steps(tmp_path) == (steps[len(steps) - keep:] if keep else [])


def test_prune_keeps_newest_plus_best_exactly(tmp_path):
    for s in range(0, 24, 4):
        _save(tmp_path, s)
        if s == 4:
            mark_best(tmp_path, 4, 0.6)
        prune_checkpoints(tmp_path, 2)
    assert _steps(tmp_path) == [4, 16, 20]


def test_best_pointer_to_a_removed_or_incomplete_checkpoint_is_none(tmp_path):
    p = _save(tmp_path, 3)
    mark_best(tmp_path, 3, 0.4)
    (p / "index.json").unlink()  # incomplete now
    assert read_best(tmp_path)["step"] == 3 and best_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints" / BEST_FILE).write_text("{not json")
    assert read_best(tmp_path) is None and best_checkpoint(tmp_path) is None
    assert best_checkpoint(tmp_path / "nowhere") is None


def test_sync_best_after_rollback_and_resume(tmp_path):
    for s in (4, 8, 12):
        _save(tmp_path, s)
    mark_best(tmp_path, 12, 0.7)
    # a rollback to step 8 whose state says the best was step 4: the best of the superseded timeline goes
    assert sync_best(tmp_path, 4, 0.55) == checkpoint_dir(tmp_path, 4)
    assert read_best(tmp_path)["step"] == 4 and read_best(tmp_path)["value"] == 0.55
    assert os.readlink(tmp_path / "checkpoints" / BEST_LINK) == "global_step_4"
    # a state whose best step has no checkpoint (a run from before best checkpoints) or no best at all: no pointer
    assert sync_best(tmp_path, 6, 0.6) is None
    assert read_best(tmp_path) is None and not (tmp_path / "checkpoints" / BEST_LINK).is_symlink()
    mark_best(tmp_path, 8, 0.6)
    assert sync_best(tmp_path, -1, -1.0) is None and read_best(tmp_path) is None
    # a resume whose state agrees with the pointer leaves it as it is
    mark_best(tmp_path, 8, 0.6)
    before = (tmp_path / "checkpoints" / BEST_FILE).read_text()
    assert sync_best(tmp_path, 8, 0.6) == checkpoint_dir(tmp_path, 8)
    assert (tmp_path / "checkpoints" / BEST_FILE).read_text() == before
    # a pointer whose link went missing is repaired
    (tmp_path / "checkpoints" / BEST_LINK).unlink()
    sync_best(tmp_path, 8, 0.6)
    assert os.readlink(tmp_path / "checkpoints" / BEST_LINK) == "global_step_8"
