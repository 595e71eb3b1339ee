"""tasks.trajectory: the one field spec, and that its consumers are views of it."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks import trajectory as tj

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "trajectory.md"  # generated: pipelines.reference
BEGIN, END = "<!-- trajectory-fields:begin -->", "<!-- trajectory-fields:end -->"


def test_reference_page_table_is_the_spec_rendering():
    text = PAGE.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{PAGE} needs one trajectory-fields block"
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert table == tj.markdown(), f"{PAGE}'s trajectory table differs: run `python -m pipelines.reference`"
    out = subprocess.run([sys.executable, "-m", "tasks.trajectory", "--markdown"], capture_output=True, text=True,
                         check=True, cwd=PAGE.parents[2]).stdout.strip()
    assert out == tj.markdown()


@pytest.mark.parametrize("image,action_level", [(None, False), (16, True)])
def test_zarr_schema_from_dims(image, action_level):
    """Hand-derived: O=7, D=4, C=3; V = C with action-level rewards, else 1; rgb only with an image."""
    V = 3 if action_level else 1
    d = tj.Dims(obs_dim=7, action_dim=4, num_action_chunks=3, num_values=V, image_size=image,
                action_level=action_level)
    got = {k: (v.shape, v.dtype) for k, v in tj.zarr_schema(d).items()}
    want = {"obs": ((7,), "float32"), "actions": ((3, 4), "float32"), "logprobs": ((3, 4), "float32"),
            "values": ((V,), "float32"), "final_values": ((V,), "float32"), "rewards": ((3,), "float32"),
            "terminated": ((), "bool"), "truncated": ((), "bool"), "step_mask": ((3,), "bool"),
            "success": ((), "bool"), "episode_seed": ((), "int64"), "episode_id": ((), "int64"),
            "task_id": ((), "int64"), "trial_id": ((), "int64")}  # per-sample prompt index, init state (issue 12)
    if image:
        want["rgb"] = ((image, image, 3), "uint8")
    assert got == want
    rec = {k: (v.shape, v.dtype) for k, v in tj.record_schema(d).items()}
    assert rec == {k: v for k, v in want.items() if k not in ("logprobs", "values", "final_values")}
    adv = tj.shapes(["advantages", "returns", "loss_mask"], d)
    assert adv == {"advantages": ((3,) if action_level else (), "float32"),
                   "returns": ((3,) if action_level else (), "float32"), "loss_mask": ((), "bool")}


def test_views_are_consistent():
    # what the store holds is what the rollout produces; the update's samples are its passthrough + advantages'
    assert set(tj.STORED_FIELDS) <= {f.name for f in tj.FIELDS if tj.is_step_field(f.name)}
    assert set(tj.SAMPLE_FIELDS) == set(tj.PASSTHROUGH) | {"advantages", "returns", "loss_mask"}
    assert set(tj.REPLAY_FIELDS) <= set(tj.STORED_FIELDS) and set(tj.RECORDED_FIELDS) <= set(tj.STORED_FIELDS)
    assert set(tj.STEP_FIELDS) == set(tj.OBSERVATION) - {"rgb"} | set(tj.POLICY_OUTPUTS) | set(tj.ENV_OUTPUTS) | {
        "final_values"}
    assert tj.is_step_field("extras/chain") and tj.is_sample_field("extras/chain")
    assert not tj.is_step_field("bootstrap_values") and not tj.is_step_field("advantages")
    assert not tj.is_step_field(tj.Meta.CURSOR) and {k for k, _, _ in tj.META} == {
        v for k, v in vars(tj.Meta).items() if k.isupper()}
    traj = {"obs": np.zeros((2, 1, 3), np.float32), "rgb": np.zeros((2, 1, 4, 4, 3), np.uint8),
            "extras/chain": np.zeros((2, 1, 5)), tj.Meta.CURSOR: {}, "bootstrap_values": np.zeros((1, 1))}
    assert sorted(tj.stored_part(traj)) == ["obs", "rgb"]  # extras, bookkeeping and bootstrap are never stored


def test_a_field_names_a_known_source():
    with pytest.raises(ValueError, match="source 'simulator'"):
        tj.Field("x", "", lambda d: (), "float32", "simulator", "?", stored=False, update=False)
