"""The error of a machine that cannot run a simulator (a family's adapter raises a subclass: ManiSkill's
VulkanMissingError). Callers catch this one, never a family's own class."""
from __future__ import annotations


class SimulatorUnavailable(RuntimeError):
    """This machine lacks what a simulator needs (a driver, a library); the message is one line with the fix."""
