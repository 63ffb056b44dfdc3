"""The benchmark driver renders every bench's raw JSON (torch backend's committed run, Triton-style cases)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_render_committed_and_triton_style_results() -> None:
    import run  # benchmarks/run.py (conftest puts the folder on sys.path)

    torch_raw = json.loads((ROOT / "docs" / "benchmarks" / "ep-a2a-torch.json").read_text())
    triton_raw = {
        "device": "GPU",
        "world_size": 2,
        "cases": [
            {
                "shape": "deepseek-v3",
                "routing": "uniform",
                "tokens": 128,
                "hidden": 7168,
                "experts": 256,
                "topk": 8,
                "heap": "torch",
                "nvlink_bytes": 10**6,
                "results": {
                    "ce": {"copy_ms": 0.01},
                    "hbm-write": {"write_ms": 0.004, "rows": 1000, "bytes": 14336000},
                    "ours-sm32": {"dispatch_ms": 0.02, "combine_ms": 0.03, "round_trip_ms": 0.05},
                    "ours-graph-sm32": {
                        "dispatch_ms": 0.02,
                        "combine_ms": 0.03,
                        "dispatch_ms_no_lead": 0.04,
                        "combine_ms_no_lead": 0.05,
                    },
                    "ours-static-eager-sm32": {
                        "dispatch_ms": 0.04,
                        "combine_ms": 0.05,
                        "dispatch_ms_lead": 0.025,
                    },
                },
                "varying": {
                    "low": 32,
                    "high": 128,
                    "speculative": {
                        "dispatch_ms": 0.3,
                        "dispatch_ms_lead": 0.2,
                        "overflows": 1,
                        "speculative_calls": 40,
                    },
                    "no_speculation": {"dispatch_ms": 0.4, "dispatch_ms_lead": 0.35},
                },
            }
        ],
        "first_call": {"use_aot": True, "first_dispatch_combine_s": 0.1},
    }
    md = run.render({"benches": {"torch": torch_raw, "triton": triton_raw}})
    assert "## torch" in md
    assert "## triton" in md
    assert "| ours-graph-sm32 | 0.020 | 50 | 50 | 0.030 | 33 | 33 | - | - |" in md
    # the graph-vs-eager comparison: each timing also shown the other way around the device-side lead
    assert "| ours-graph-sm32 (without the lead) | 0.040 | 25 | 25 | 0.050 | 20 | 20 | - | - |" in md
    assert "| ours-static-eager-sm32 (after the lead) | 0.025 | 40 | 40 | - | - | - | - | - |" in md
    # batch sizes that change every call: one sentence under the table
    assert (
        "over batch sizes that change every call (32 to 128 tokens per rank, drawn per rank, median per "
        "call): with speculative rows 0.300 ms (0.200 after the lead, 1 of 40 calls outgrew their "
        "outputs); without 0.400 ms (0.350 after the lead)." in md
    )
    # the HBM write floor: the busiest rank's expert rows written once (14.336 MB in 4 us)
    assert (
        "| hbm-write (the busiest rank's 1000 expert rows, 14 MB, written once) | 0.004 | 3584 (written) |"
        in md
    )
    # every committed case appears with its baselines
    for case in torch_raw["cases"]:
        assert f"{case['tokens']} tokens/rank" in md
    for name in ("ce (bytes only)", "nccl-a2a (bytes only)", "| torch |", "| nccl-dest |", "| nccl-expert |"):
        assert name in md


def test_busiest_rank_bytes() -> None:
    """Bytes are those of the busiest rank: max over ranks of max(sent, received)."""
    import bench_triton as bench
    import torch

    # 2 ranks: sent by one = received by the other
    assert bench.busiest_tokens(torch.tensor([[0, 7], [5, 0]])) == (7, [7, 5], [5, 7])
    # 4 ranks, everyone sends to the hot rank 0: it receives 3 x 4 = 12 while nobody sends more than 6
    m = torch.tensor([[0, 2, 2, 2], [4, 0, 1, 1], [4, 1, 0, 1], [4, 1, 1, 0]])
    tokens, sent, recv = bench.busiest_tokens(m)
    assert (tokens, max(sent), recv[0]) == (12, 6, 12)


def test_busiest_rank_bytes_properties() -> None:
    """For any crossing matrix: no rank sends or receives more than the figure, and some rank does it."""
    import bench_triton as bench
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(
        st.integers(2, 8).flatmap(lambda w: st.lists(st.integers(0, 4096), min_size=w * w, max_size=w * w))
    )
    def check(flat: list[int]) -> None:
        w = int(len(flat) ** 0.5)
        m = torch.tensor(flat, dtype=torch.int64).reshape(w, w)
        m.fill_diagonal_(0)
        tokens, sent, recv = bench.busiest_tokens(m)
        assert sent == m.sum(1).tolist()
        assert recv == m.sum(0).tolist()
        assert all(v <= tokens for v in sent + recv)
        assert tokens in sent + recv
        if w == 2:  # two ranks: what one sends the other receives
            assert tokens == max(sent)

    check()


def test_run_record_commit(tmp_path, monkeypatch) -> None:
    """The record's commit: ``EP_A2A_COMMIT`` when set, else git's HEAD, and None outside a checkout
    (the device machines' copy of the tree has no .git) rather than git's "HEAD" or an error."""
    import run_record

    monkeypatch.setenv("EP_A2A_COMMIT", "c7ea301")
    assert run_record.commit() == "c7ea301"
    monkeypatch.delenv("EP_A2A_COMMIT")
    monkeypatch.chdir(ROOT)
    head = run_record.commit()
    assert head is None or (len(head) == 40 and int(head, 16) >= 0)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert run_record.commit() is None
