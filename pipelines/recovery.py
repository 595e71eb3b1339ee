"""Moved to `pipelines.runner.recovery` (the runner's recovery from lost and stalled workers); this name stays
importable and IS that module (one module object: patching `pipelines.recovery.X` patches the real one)."""
import sys

from pipelines.runner import recovery as _recovery

sys.modules[__name__] = _recovery
