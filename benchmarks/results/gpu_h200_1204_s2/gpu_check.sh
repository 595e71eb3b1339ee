#!/bin/bash
# Device check (not part of the project): the gpu-marked tests, the default job on CUDA, the policy table on CUDA.
# Run on the lent H200 (2026-12-04, session 2) from the repository root as
#   bash benchmarks/results/gpu_h200_1204_s2/gpu_check.sh        (device tool: carry .whl and .gl)
# with two folders that are not in the repository (ignored through .git/info/exclude):
# .whl/site312.tar.xz: the project's dependencies that the machine's image lacks (or has too old), cp312 manylinux
#   wheels unpacked into one folder and xz'd (~45 MB): dask/distributed 2026.8.0, zarr 3.1.6 (+numcodecs, donfig,
#   google-crc32c), mlflow-skinny/-tracing 3.17.2 (+sqlalchemy, alembic, Mako, fastapi, starlette, opentelemetry,
#   databricks-sdk), hydra-core 1.3.8, omegaconf 2.3.1, pydantic 2.14.4, gymnasium 1.4.0, ManiSkill 3.0.1 (robot
#   assets other than the panda removed) and SAPIEN 3.0.3 (headers, sensor assets and OIDN's CUDA device removed),
#   pytorch-kinematics 0.7.6, transformers 5.25.0 + huggingface_hub 2.4.0 (+httpx2, httpcore2, truststore),
#   typing_extensions 4.16.0; package list in this folder's README/report. Not carried: imageio-ffmpeg (a 68 MB
#   wheel; the default job's eval videos are skipped with a message), SAPIEN's GPU PhysX library (downloaded from
#   GitHub at first use; the machine has no network, so the physx_cuda test skips).
# .whl/shim/: stand-ins for IPython (IPython.display, imported by ManiSkill) and cryptography.fernet (imported by
#   MLflow's registry models); the runs use neither.
# .gl/: Debian's libvulkan1 and glvnd libraries (device README's recipe).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.." || exit 1
T0=$(date +%s); el(){ echo "== +$(( $(date +%s) - T0 )) s: $*"; }
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
mkdir -p /tmp/site && tar xJf .whl/site312.tar.xz -C /tmp/site && cp -r .whl/shim/* /tmp/site/ || exit 1
el "site unpacked"
for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; ldconfig -p | grep -i "libvulkan\|libEGL" | head -4
ls /usr/local/nvidia/share/vulkan/icd.d/ /usr/local/nvidia/share/glvnd/egl_vendor.d/ 2>&1
python3 -m pip list 2>/dev/null | grep -i -E "^(numpy|typing.extensions|tokenizers|hf-xet|pytest|pytest-timeout|torch|opencv-python-headless|huggingface.hub|transformers) "
} 2>&1 | tee $OUT/env.log
[ -f /tmp/site/mani_skill/__init__.py ] && [ -f /tmp/site/IPython/display.py ] || { echo "site unpack failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
export VK_ICD_FILENAMES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
python3 -c "
import torch, dask, distributed, mlflow, zarr, mani_skill, sapien, omegaconf, transformers, huggingface_hub, pydantic, gymnasium
print('torch', torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')
print('transformers', transformers.__version__, 'hub', huggingface_hub.__version__, 'dask', dask.__version__, 'mlflow', mlflow.__version__, 'zarr', zarr.__version__, 'mani_skill', mani_skill.__version__, 'sapien', sapien.__version__, 'pydantic', pydantic.__version__)
" 2>&1 | grep -v -i warn | tee -a $OUT/env.log
set -o pipefail
el "gpu tests" | tee -a $OUT/env.log
timeout 150 python3 -m pytest -p no:cacheprovider -m gpu -rs -v tests/tasks/test_offload.py tests/tasks/test_device.py tests/tasks/envs/test_batched.py 2>&1 | tee $OUT/gpu_tests.log | tail -30
echo "pytest rc=$?" | tee -a $OUT/env.log
el "default job on cuda" | tee -a $OUT/env.log
timeout 90 python3 -m pipelines.run policy.device=cuda policy.dtype=bfloat16 runner.max_steps=4 run_root=/tmp/runs 2>&1 | tee $OUT/run_ppo_cuda.log | tail -25
echo "run rc=$?" | tee -a $OUT/env.log
el "policies on cuda" | tee -a $OUT/env.log
timeout 100 python3 benchmarks/policies.py --device cuda --dtype bfloat16 --batch 8 --repeats 3 2>&1 | tee $OUT/policies_cuda.log | grep -v -i warn | tail -12
echo "policies rc=$?" | tee -a $OUT/env.log
el "vulkan probe" | tee -a $OUT/env.log
timeout 40 python3 -c "import sapien; r = sapien.render.RenderSystem(); print('render device', r.device)" 2>&1 | tail -4 | tee -a $OUT/env.log
el "done" | tee -a $OUT/env.log
