"""Shared test configuration: GPU tests skip cleanly on machines without CUDA."""

import pytest
import torch


def _has_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    if _has_hopper():
        return
    skip = pytest.mark.skip(reason="needs a CUDA Hopper GPU (sm_90); run on the H200 with -m gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seeded():
    """A fresh generator per test: random inputs, never zeros, reproducible on failure."""
    return torch.Generator().manual_seed(1234)
