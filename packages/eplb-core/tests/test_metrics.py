import pytest
import torch

from eplb_core import balancedness, lower_bound, plan, synthetic_loads


def test_balancedness_values() -> None:
    loads = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(balancedness(loads), torch.tensor([1.0, 0.25, 1.0], dtype=torch.float64))


def test_balancedness_rejects_wrong_rank() -> None:
    with pytest.raises(ValueError, match="gpu_loads"):
        balancedness(torch.ones(3))


@pytest.mark.parametrize(
    ("loads", "match"),
    [
        pytest.param([[1.0, float("nan")]], "NaN", id="nan"),
        pytest.param([[1.0, float("inf")]], "infinite", id="inf"),
        pytest.param([[1e308, 1e308]] * 2, None, id="huge-finite"),
        pytest.param([[1.0, -1.0]], "negative", id="negative"),
        pytest.param(torch.zeros(0, 4), "gpu_loads", id="empty"),
    ],
)
def test_balancedness_non_finite_and_bad_values(loads: object, match: str | None) -> None:
    t = torch.as_tensor(loads, dtype=torch.float64)
    if match is None:  # finite loads near the float64 limit still have a finite mean
        torch.testing.assert_close(balancedness(t), torch.ones(2, dtype=torch.float64))
        return
    with pytest.raises(ValueError, match=match):
        balancedness(t)


def test_balancedness_of_overflowed_gpu_sums_raises() -> None:
    w = torch.full((1, 4), 1e308, dtype=torch.float64)
    per_gpu = w.view(1, 2, 2).sum(-1)  # inf: the sum overflowed
    with pytest.raises(ValueError, match="infinite"):
        balancedness(per_gpu)


@pytest.mark.parametrize(
    ("weight", "args", "kwargs", "match"),
    [
        pytest.param(torch.ones(2, 8), (6, 1, 1, 2), {}, "num_replicas", id="replicas-below-experts"),
        pytest.param(torch.tensor([[1.0, float("nan")]]), (2, 1, 1, 1), {}, "NaN", id="nan"),
        pytest.param(torch.ones(2, 8), (8, 1, 1, 0), {}, "num_gpus", id="zero-gpus"),
        pytest.param(torch.ones(2, 8), (8, 1, 1, 3), {}, "num_gpus", id="gpus-not-dividing"),
        pytest.param(torch.ones(8), (8, 1, 1, 2), {}, "weight", id="rank1"),
        pytest.param(torch.ones(2, 8), (8, 1, 1, 2), {"mode": "fast"}, "mode", id="bad-mode"),
        pytest.param(
            torch.full((2, 8), 1e308, dtype=torch.float64), (8, 1, 1, 2), {}, "overflow", id="overflow"
        ),
    ],
)
def test_lower_bound_validates_arguments(weight: torch.Tensor, args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        lower_bound(weight, *args, **kwargs)


def test_lower_bound_below_every_plan() -> None:
    w = synthetic_loads(3, 32, num_groups=4, seed=4)
    bound = lower_bound(w, 40, 4, 2, 8)
    assert bound.shape == (3,)
    assert bool(
        (plan(w, num_replicas=40, num_groups=4, num_nodes=2, num_gpus=8).gpu_loads.amax(1) >= bound).all()
    )
