#!/bin/bash
# Device check 2 of session 5 (not part of the project), with gpu_check.sh's .whl/.gl bundle: after the fix that
# moves the embedded workers out of the driver's session (pipelines/worker_preload.py) — found by gpu_check.sh's
# `timeout 90`, whose SIGTERM to the whole process group killed the workers and lost the finished steps — repeat
# that situation on CUDA: the gpu-marked tests on the final code, then the default job on CUDA stopped by
# `timeout -s TERM` (group signal) mid-run, which must checkpoint its finished steps, then resumed from them.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../../.." || exit 1
T0=$(date +%s); el(){ echo "== +$(( $(date +%s) - T0 )) s: $*"; }
mkdir -p /tmp/site && tar xJf .whl/site312.tar.xz -C /tmp/site && cp -r .whl/shim/* /tmp/site/ || exit 1
for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
export PYTHONPATH=/tmp/site:$PWD
export VK_ICD_FILENAMES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
set -o pipefail
el "gpu tests" | tee $OUT/check2.log
timeout 120 python3 -m pytest -p no:cacheprovider -m gpu -rs -q tests/tasks/test_offload.py tests/tasks/test_device.py tests/tasks/envs/test_batched.py 2>&1 | tail -6 | tee -a $OUT/check2.log
el "default job on cuda, SIGTERM to the group after 75 s" | tee -a $OUT/check2.log
timeout -s TERM 75 python3 -m pipelines.run policy.device=cuda policy.dtype=bfloat16 runner.max_steps=200 runner.save_interval=200 runner.val_check_interval=200 runner.progress=false run_root=/tmp/r3 > $OUT/sigterm_run.log 2>&1
echo "rc=$?" | tee -a $OUT/check2.log
grep -E "lost during|rolled back|interrupted|error" $OUT/sigterm_run.log | tee -a $OUT/check2.log
RID=$(grep -o "runner.resume=[0-9a-f-]*" $OUT/sigterm_run.log | head -1 | cut -d= -f2)
N=$(grep -o "at step [0-9]*: checkpointed" $OUT/sigterm_run.log | grep -o "[0-9]*")
ls /tmp/r3/pushcube_ppo/$RID/checkpoints | tee -a $OUT/check2.log
el "resume $RID from step $N to step $((N + 2))" | tee -a $OUT/check2.log
timeout 150 python3 -m pipelines.run policy.device=cuda policy.dtype=bfloat16 runner.resume=$RID runner.max_steps=$((N + 2)) runner.save_interval=200 runner.val_check_interval=200 runner.progress=false run_root=/tmp/r3 > $OUT/resume_run.log 2>&1
echo "rc=$?" | tee -a $OUT/check2.log
grep -E "resum|dagrl: done|error" $OUT/resume_run.log | tee -a $OUT/check2.log
el "done" | tee -a $OUT/check2.log
