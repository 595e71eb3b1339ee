"""The cluster's one error type beyond ConfigError (no dagrl import but tasks.config.errors)."""
from __future__ import annotations

from tasks.config.errors import ConfigError


class PlacementError(ConfigError):
    """The cluster cannot run the placement the config asks for."""
