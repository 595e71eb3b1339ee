"""Find a Vulkan driver for SAPIEN (ManiSkill needs one even for state observations).

Order of preference: an explicit `VK_ICD_FILENAMES` / `VK_DRIVER_FILES`; a system GPU driver (any ICD json in the
standard directories that is not Mesa's lavapipe); the project's own Mesa 25 lavapipe that `scripts/setup.sh`
unpacks into `.vulkan/` (Debian 12's own lavapipe is too old for SAPIEN: `ErrorIncompatibleDriver`).
"""
from __future__ import annotations

import os
from pathlib import Path

from tasks.envs.errors import SimulatorUnavailable

PROJECT_ICD = Path(__file__).resolve().parents[3] / ".vulkan" / "lvp_icd.json"
SYSTEM_ICD_DIRS = ("/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d",
                   "/usr/local/nvidia/share/vulkan/icd.d")
FIX = ("run scripts/setup.sh (it unpacks Mesa's software Vulkan into .vulkan/), install your GPU's Vulkan "
       "driver, or point VK_ICD_FILENAMES at an ICD json")


class VulkanMissingError(SimulatorUnavailable):
    """No usable Vulkan driver; the message says how to get one."""


def find_vulkan_icd() -> tuple[str | None, str]:
    """Return (icd_json_path or None when the system default should be used, a one-word source label).

    Returns (None, "none") when no driver at all was found.
    """
    for var in ("VK_ICD_FILENAMES", "VK_DRIVER_FILES"):
        if os.environ.get(var):
            return os.environ[var], "env"
    for d in SYSTEM_ICD_DIRS:
        p = Path(d)
        if p.is_dir() and any("lvp" not in f.name for f in p.glob("*.json")):
            return None, "system"
    if PROJECT_ICD.is_file():
        return str(PROJECT_ICD), "project"
    return None, "none"


def vulkan_env() -> dict[str, str]:
    """Environment variables a worker process needs for SAPIEN.

    Raises:
        VulkanMissingError: no driver found; the message names the fix.
    """
    icd, source = find_vulkan_icd()
    if source == "none":
        raise VulkanMissingError(f"no Vulkan driver found (ManiSkill/SAPIEN needs one even for state obs): {FIX}")
    return {"VK_ICD_FILENAMES": icd} if icd else {}


def ensure_vulkan() -> None:
    """Set `VK_ICD_FILENAMES` in this process (before SAPIEN is imported) when the project's lavapipe is needed."""
    os.environ.update(vulkan_env())
