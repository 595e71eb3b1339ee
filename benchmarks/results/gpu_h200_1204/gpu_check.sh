#!/bin/bash
# Device check (not part of the project): the gpu-marked tests, the VLA presets on the GPU, two short runs.
# As run on the lent H200 (2026-12-04), from the repository root, with two folders that are not in the repository:
# .whl/ (site312.tar.xz: the project's dependencies missing from that machine's image as cp312 wheels unpacked into
# one xz tarball, ~61 MB: dask, distributed, zarr, mlflow-skinny + sqlalchemy/alembic, hydra, omegaconf, pydantic,
# gymnasium, ManiSkill 3.0.1 and SAPIEN 3.0.3 with the unused robot assets removed, transformers 5.24.0; shim/ with
# stand-ins for IPython.display and cryptography.fernet that ManiSkill and MLflow import but the runs never use;
# ckpt/flow_sft_hf: an SFT checkpoint of the tiny flow VLA) and .gl/ (Debian's libvulkan1 and the glvnd libraries,
# device/README's recipe). The ':'-prefixed lines were skipped in the last call (they had run in an earlier one).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
T0=$(date +%s); el(){ echo "== +$(( $(date +%s) - T0 )) s: $*"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
mkdir -p /tmp/site && tar xJf .whl/site312.tar.xz -C /tmp/site && cp -r .whl/shim/* /tmp/site/ || exit 1
export PYTHONPATH=/tmp/site:$PWD
for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; ldconfig -p | grep -i "vulkan\|GLX_nvidia" | head -4; cat /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json | head -8
export VK_ICD_FILENAMES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
ls /usr/local/nvidia/share/vulkan/icd.d/ 2>&1
python3 -c "import transformers; print('transformers', transformers.__version__)"; python3 -c "import torch, dask, distributed, mlflow, zarr, mani_skill, sapien, omegaconf; print('torch', torch.__version__, torch.cuda.is_available(), 'dask', dask.__version__)" 2>&1 | tail -3
el "gpu tests"
: timeout 150 python3 -m pytest -p no:cacheprovider -m gpu -rs -v tests/tasks/test_offload.py tests/tasks/test_device.py tests/tasks/envs/test_batched.py tests/tasks/envs/test_maniskill.py 2>&1 | tee $OUT/gpu_tests.log | tail -25
: timeout 40 env.sim_backend=physx_cuda 2>&1 | grep -v Warn | tail -3
el "policies on cuda"
: timeout 110 python3 benchmarks/policies.py --device cuda --dtype bfloat16 --batch 8 --repeats 3 2>&1 | tee $OUT/policies_cuda.log | grep -v Warn | tail -12
probe(){ timeout 60 python3 -c "import sapien; r = sapien.render.RenderSystem(); print('render device', r.device)" 2>&1 | grep -v -i warn | tail -2; }
el "probe with ICD override"; if ! probe | grep -q "render device"; then probe; unset VK_ICD_FILENAMES VK_DRIVER_FILES; el "probe with the loader's default"; probe | tee /dev/stderr | grep -q "render device" || { el "no Vulkan"; exit 0; }; fi
el "default job on cuda"
: timeout 90 python3 -m pipelines.run policy.device=cuda policy.dtype=bfloat16 runner.max_steps=4 run_root=/tmp/runs 2>&1 | tee $OUT/run_ppo_cuda.log | tail -15
el "flow grpo on cuda"
timeout 165 python3 -m pipelines.run conf=pushcube_flow_grpo policy.model_path=$PWD/.whl/ckpt/flow_sft_hf policy.device=cuda policy.dtype=bfloat16 env.num_envs=256 env.num_shards=8 cluster.num_env_workers=8 runner.val_at_start=false runner.max_steps=2 run_root=/tmp/runs 2>&1 | tee $OUT/run_flow_cuda.log | tail -15
el "done"
