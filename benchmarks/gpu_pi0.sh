#!/usr/bin/env bash
# The GPU check of the pi0 / pi05 families on a CUDA machine, in one command of a few minutes:
#   1. benchmarks/gpu_pi0.py (base presets, random weights, bf16: act latency per env batch, one PPO step with LoRA
#      r=16 and with full fine-tuning + gradient checkpointing, update time, peak memory; table + JSON under OUT),
#   2. pytest -m gpu on the test files that hold GPU tests.
#
#   bash benchmarks/gpu_pi0.sh --fetch-wheels   # HERE (a machine with pip and the internet): the packages a bare
#                                               # CUDA image lacks, as Python 3.12 x86-64 wheels, into .whl/
#   bash benchmarks/gpu_pi0.sh [OUT]            # THERE: installs .whl/*.whl (if any) into /tmp/site, runs 1 and 2;
#                                               # OUT defaults to $OUT, else /tmp/gpu_pi0
# Extra arguments for gpu_pi0.py: GPU_PI0_ARGS="--families pi0 --envs 8 32" bash benchmarks/gpu_pi0.sh
# Without CUDA, gpu_pi0.py stops at once (exit 2) with one line saying so.
set -uo pipefail
cd "$(dirname "$0")/.."

# what the device image (KINDS.md: torch, numpy, tokenizers, safetensors, huggingface_hub 1.x, transformers 5.17, ...)
# lacks for tasks.actor / tasks.policies.pi0, at this checkout's .venv versions: transformers with PI0 (5.25: needs
# huggingface_hub >= 2.4, whose httpx2 stack, and kernels), peft, dask + distributed (tasks.resident's WorkerPlugin),
# and their dependencies that the image lacks or holds too old (25 MB in all)
WHEELS=(transformers==5.25.0 huggingface_hub==2.4.0 hf-xet==1.8.0 httpx2==2.17.0 httpcore2==2.17.0 truststore
        h11==0.16.0 anyio==4.16.0 idna==3.21 typing_extensions==4.16.0 click==8.5.1 kernels==0.19.1 tomlkit
        peft==0.21.2 dask==2026.8.0 distributed==2026.8.0 tornado==6.6.1 tblib==3.2.2 zict==3.0.0 partd==1.4.2
        locket==1.0.0)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  PY=${PYTHON:-python3}
  $PY -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}" || exit 1
  du -sh .whl
  exit 0
fi

OUTDIR=${1:-${OUT:-/tmp/gpu_pi0}}
mkdir -p "$OUTDIR"
PY=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_pi0.sh: installing .whl/*.whl failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$OUTDIR/gpu.txt"

t0=$(date +%s)
# shellcheck disable=SC2086
$PY benchmarks/gpu_pi0.py --out "$OUTDIR" ${GPU_PI0_ARGS:-} 2>&1 | tee "$OUTDIR/gpu_pi0.log"
bench=${PIPESTATUS[0]}
echo "gpu_pi0.py: exit $bench after $(( $(date +%s) - t0 )) s"
[[ $bench == 2 ]] && exit 2  # no CUDA or a missing package: nothing else can run either

# the GPU tests: the files that hold `@pytest.mark.gpu` tests (tests/tasks/test_device.py composes configs with
# Hydra and imports MLflow: it runs where those are importable, else it is named as skipped)
files=(tests/tasks/test_offload.py)
if $PY -c "import hydra, omegaconf, mlflow, zarr" 2>/dev/null; then
  files+=(tests/tasks/test_device.py)
else
  echo "pytest -m gpu: tests/tasks/test_device.py skipped (hydra / omegaconf / mlflow / zarr not importable here)"
fi
t1=$(date +%s)
$PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" "${files[@]}" 2>&1 | tee "$OUTDIR/pytest_gpu.log"
tests=${PIPESTATUS[0]}
echo "pytest -m gpu: exit $tests after $(( $(date +%s) - t1 )) s"
exit $(( bench != 0 || tests != 0 ))
