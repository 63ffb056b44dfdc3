import pytest
import torch

from eplb_core import balancedness


def test_balancedness_values() -> None:
    loads = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(balancedness(loads), torch.tensor([1.0, 0.25, 1.0], dtype=torch.float64))


def test_balancedness_rejects_wrong_rank() -> None:
    with pytest.raises(ValueError, match="gpu_loads"):
        balancedness(torch.ones(3))
