"""The RL properties of the flow family, through the whole graph, for transformers' pi0 / pi05 (tiny presets on
PushCube images): at a learning rate of ~0 the PPO ratio of every minibatch is 1 (the update recomputes the
rollout's log-probs exactly from the stored denoising chain) for Flow-SDE and Flow-Noise, with colocated and
disaggregated inference and on 2 FSDP actor ranks; and LoRA runs sync only the adapters (`system/weight_sync_mb`
drops to the trainable tensors' size after the first load).

One run is ~30-40 s on the 2-core VM (measured), so the default suite runs the cheapest run per property (each
family, each noise method, each layout at least once); the rest of the {pi0, pi05} x {flow_sde, flow_noise} x
{colocated, 2 ranks} matrix is `slow` (disaggregated inference computes the same log-probs on another worker: one
cell covers it).
"""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from pipelines.run import main as run_main
from storage.tracking import default_tracking_uri

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

pytest.importorskip("transformers")

SMALL = ["conf=smoke", "env=pushcube_vla", "env.image_size=32", "env.num_envs=4", "env.num_shards=2",
         "env.max_episode_steps=10", "rollout.chunk_steps=2", "env.eval.num_envs=2", "env.eval.num_episodes=2",
         "runner.val_at_start=false", "runner.progress=false",
         "cluster.dashboard_address=127.0.0.1:0", "algorithm.update_epochs=2", "algorithm.num_minibatches=2"]
LAYOUTS = {
    "colocated": ["rollout.chunk_steps_per_node=2"],
    "disaggregated": ["rollout.inference=disaggregated"],
    "ranks2": ["rollout.chunk_steps_per_node=2", "algorithm.num_actor_ranks=2", "cluster.num_gpu_workers=2",
               "cluster.component_placement.actor=0-1"],
}
# the default suite's subset: every family, method and layout at least once
DEFAULT = {("pi0", "flow_sde", "colocated"), ("pi05", "flow_noise", "colocated"),
           ("pi0", "flow_noise", "disaggregated"), ("pi05", "flow_sde", "ranks2")}
# ratio = exp(new - old) of log-probs summed over the chunk's C x D dims: the rollout's and the update's forward run
# on other batch sizes, so float32 reductions may differ by a few ulp per term; 1e-6 bounds that and is far below
# what one step at the presets' lr moves (|ratio_mean - 1| = 2e-5 LoRA, 2e-4 full, pi0 tiny, measured)
TOL = 1e-6


def _metrics(root, keys) -> dict[str, list[tuple[int, float]]]:
    client = MlflowClient(tracking_uri=default_tracking_uri(root))
    run = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])[0]
    assert run.info.status == "FINISHED"
    return {k: [(m.step, m.value) for m in sorted(client.get_metric_history(run.info.run_id, k),
                                                  key=lambda m: m.step)] for k in keys}


def _matrix():
    for family in ("pi0", "pi05"):
        for method in ("flow_sde", "flow_noise"):
            for layout in LAYOUTS:
                if layout == "disaggregated" and (family, method, layout) not in DEFAULT:
                    continue
                marks = () if (family, method, layout) in DEFAULT else (pytest.mark.slow,)
                yield pytest.param(family, method, layout, marks=marks, id=f"{family}-{method}-{layout}")


@pytest.mark.parametrize("family,method,layout", list(_matrix()))
def test_ratio_is_one_at_lr_zero(tmp_path, family, method, layout):
    assert run_main([*SMALL, f"policy={family}_tiny", f"policy.noise_method={method}", "algorithm.lr=1e-12",
                     "algorithm.target_kl=null", "runner.max_steps=2", f"run_root={tmp_path}",
                     *LAYOUTS[layout]]) == 0
    m = _metrics(tmp_path, ["train/ratio_mean", "train/approx_kl", "train/clipfrac"])
    assert [s for s, _ in m["train/ratio_mean"]] == [1, 2]
    for key, want in (("train/ratio_mean", 1.0), ("train/approx_kl", 0.0), ("train/clipfrac", 0.0)):
        assert all(abs(v - want) <= TOL for _, v in m[key]), (key, m[key])


def test_lora_run_syncs_only_the_adapters(tmp_path):
    """pi0 tiny with rank-4 LoRA: step 1's replicas load the base (the init's full weights: 2 shards' replicas x the
    full state dict), step 2's only the trainable tensors (adapters and heads), sizes from the policy itself."""
    from pipelines.config import load_config
    from tasks import rollout
    from tasks.policies import make_policy
    from tasks.weights import state_dict_nbytes
    args = [*SMALL, *LAYOUTS["colocated"], "policy=pi0_tiny", "policy.lora_rank=4", "runner.max_steps=2",
            f"run_root={tmp_path}"]
    assert run_main(args) == 0
    cfg, _ = load_config(args)
    obs_dim, action_dim = rollout.env_dims(cfg)
    pol = make_policy(cfg.policy, obs_dim=obs_dim, action_dim=action_dim, num_values=rollout.num_values(cfg),
                      image_size=rollout.image_size(cfg), load=False)
    full, part = state_dict_nbytes(pol.state_dict()), state_dict_nbytes(pol.sync_state())
    replicas = cfg.env.num_shards  # colocated: one replica per shard's worker
    mb = dict(_metrics(tmp_path, ["system/weight_sync_mb"])["system/weight_sync_mb"])
    assert mb[1] == pytest.approx(replicas * full / 1e6, rel=1e-6)
    assert mb[2] == pytest.approx(replicas * part / 1e6, rel=1e-6) and part < full / 5
