import pytest

from ep_a2a import EPConfig


def test_config_derived_fields() -> None:
    cfg = EPConfig(
        max_tokens=8, hidden=16, topk=2, num_tot_experts=8, rank=1, world_size=4, local_world_size=4
    )
    assert cfg.num_experts_per_rank == 2
    assert cfg.is_intra_node
    assert [cfg.expert_rank(e) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_config_rejects_uneven_experts() -> None:
    with pytest.raises(ValueError, match="num_tot_experts"):
        EPConfig(max_tokens=8, hidden=16, topk=2, num_tot_experts=6, rank=0, world_size=4, local_world_size=4)
