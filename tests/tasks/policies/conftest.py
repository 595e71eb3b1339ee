"""Shared fixtures of the policy tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one intra-op thread is as fast and does not stall when the 2-core machine is shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
