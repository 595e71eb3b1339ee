"""conf=libero_smoke end to end (slow: ~4 min on the 2-core machine under load): 2 GRPO steps of the tiny flow VLA
through the real LIBERO simulator with 32 px agentview images, trajectories stored, one eval, the hf/ export."""
from __future__ import annotations

import json

import pytest

from pipelines.run import main
from storage.trajectories import TrajectoryStore


@pytest.mark.slow
def test_libero_smoke_trains_stores_and_records_the_gripper_convention(tmp_path):
    assert main(["conf=libero_smoke", f"run_root={tmp_path}"]) == 0
    run_dir = next(p for p in (tmp_path / "libero_smoke").iterdir() if p.is_dir())
    st = TrajectoryStore.open(run_dir / "trajectories.zarr")
    assert st.attrs["simulator"] == "libero" and st.attrs["gripper_convention"] == "close_positive"
    assert tuple(st.fields["rgb"].shape) == (32, 32, 3)  # the agentview per chunk step
    assert tuple(st.fields["obs"].shape) == (8,)  # the 8-D proprio state
    hf = json.loads((run_dir / "checkpoints" / "global_step_2" / "hf" / "config.json").read_text())
    assert hf["env"] == {"simulator": "libero", "env_id": "libero_spatial", "gripper_convention": "close_positive"}
