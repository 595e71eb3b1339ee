"""conf=libero_smoke end to end (slow: ~4 min on the 2-core machine under load): 2 GRPO steps of pi0 tiny
through the real LIBERO simulator with 32 px agentview images, trajectories stored (with each step's task_id /
trial_id), one eval, the hf/ export; then `pipelines.replay` re-simulates stored episodes in this process (the run
stepped them in its Dask worker processes): MuJoCo reproduces them across processes, bit for bit (Δobs = 0)."""
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
    assert hf["env"] == {"simulator": "libero", "env_id": "libero_spatial", "control_mode": "OSC_POSE",
                         "gripper_convention": "close_positive"}
    # every stored chunk step: task 5 (the run's only task); train trials from seeds 0 (both envs: one GRPO group)
    # in step 0 and 1 in step 1 (auto_reset=false: one episode per env per step)
    steps = st.complete_steps()
    assert (st.read("task_id", steps) == 5).all()
    assert [sorted(set(st.read("trial_id", [s]).ravel().tolist()) - {-1}) for s in steps] == [[0], [1]]
    from pipelines.replay import replay
    rep = replay(run_dir / "trajectories.zarr", num_episodes=2, progress=False)
    assert rep["all_verified"] and len(rep["episodes"]) == 2
    for r in rep["episodes"]:
        assert r["max_abs_obs_diff"] == 0.0 and r["max_abs_reward_diff"] == 0.0, r  # bit-exact across processes
        assert (r["task_id"], r["trial_id"]) == (5, {0: 0, 1: 0, 2: 1, 3: 1}[r["episode"]])
