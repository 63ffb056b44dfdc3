from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@pytest.fixture
def cpu_device() -> torch.device:
    """Device for the interpreter tests: CPU tensors under TRITON_INTERPRET=1."""
    if not INTERPRET:
        pytest.skip("CPU kernel tests need TRITON_INTERPRET=1 (nox -s tests sets it)")
    return torch.device("cpu")


@pytest.fixture
def cuda_device() -> torch.device:
    if INTERPRET:
        pytest.skip("GPU tests must run compiled, without TRITON_INTERPRET=1")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")
