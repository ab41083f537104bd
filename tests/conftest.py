"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Many tiny ops (and several processes) on a 2-core machine: one intra-op thread avoids OpenMP oversubscription."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
