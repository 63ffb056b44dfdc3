"""The benchmark driver's results rows and the committed results files; the benches' byte counts."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_results_rows_and_committed_file() -> None:
    """``run.rows_of`` turns a bench's raw cases into one row per (case, method) with % of the copy
    engine; the committed results files follow the shared schema and hold the figure's case."""
    import run  # benchmarks/run.py (conftest puts the folder on sys.path)

    raw = {
        "world_size": 2,
        "date": "2026-11-26T07:07:28+00:00",
        "commit": "0" * 40,
        "cases": [
            {
                "shape": "deepseek-v3", "routing": "uniform", "tokens": 4096, "hidden": 7168, "experts": 256,
                "topk": 8, "nvlink_bytes": 10**6,
                "results": {
                    "ce": {"copy_ms": 0.01},
                    "ours-graph-sm32": {"dispatch_ms": 0.02, "combine_ms": 0.04, "dispatch_ms_no_lead": 0.05},
                    "hbm-write": {"write_ms": 0.004, "rows": 1000, "bytes": 14336000},
                },
            }
        ],
    }  # fmt: skip
    rows = run.rows_of(raw, "triton")
    assert [r["method"] for r in rows] == ["ce", "ours-graph-sm32"]
    graph = rows[1]
    assert (graph["gpus"], graph["heap"], graph["dispatch_pct_ce"], graph["combine_pct_ce"]) == (
        2,
        "torch",
        50,
        25,
    )
    assert run.gpu_kind("NVIDIA H200") == "h200"
    assert run.gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    committed = sorted((ROOT / "docs" / "benchmarks" / "ep-a2a").glob("*.json"))
    assert committed, "no committed results file under docs/benchmarks/ep-a2a"
    for path in committed:
        kind = path.stem
        record = json.loads(path.read_text())
        assert {"package", "device", "gpu_kind", "date", "commit", "command", "torch", "triton"} <= set(
            record
        )
        assert record["gpu_kind"] == kind
        figure = [r for r in record["results"] if all(r[k] == v for k, v in run.FIGURE_CASE.items())]
        assert {"ours-graph-sm132", "ce"} <= {r["method"] for r in figure}


def test_low_latency_rows_in_summary_and_table() -> None:
    """The low-latency mode's rows (``run.py --low-latency``) reach the summary (graph and eager, FP8 and
    quantize-on-send, its check against the normal mode) and the benchmarks page's table."""
    import run

    raw = {
        "world_size": 4, "date": "2026-11-29T07:00:00+00:00", "commit": "0" * 40,
        "cases": [{
            "shape": "deepseek-v3", "routing": "uniform", "tokens": 128, "hidden": 7168, "experts": 256, "topk": 8,
            "nvlink_bytes": 10**6, "nvlink_bytes_fp8": 5 * 10**5, "default_num_sm": 132,
            "results": {
                "ce": {"copy_ms": 0.01},
                "ce-fp8": {"copy_ms": 0.006},
                "ours-graph-sm132": {"dispatch_ms": 0.06, "combine_ms": 0.07},
                "ours-ll-graph-sm132": {"dispatch_ms": 0.025, "combine_ms": 0.028, "fp8_dispatch_ms": 0.02,
                                        "quantize_dispatch_ms": 0.022},
                "ours-ll-sm132": {"dispatch_ms": 0.05, "combine_ms": 0.055, "rows_match_normal_mode": False,
                                  "combine_close_to_normal_mode": True},
            },
        }],
    }  # fmt: skip
    rows = run.rows_of(raw, "triton")
    text = "\n".join(run.summary(rows))
    assert (
        "low-latency mode, graph: dispatch 25 us (FP8 20, bf16 quantized on send 22), combine 28 us" in text
    )
    assert "normal mode 60 / 70 us (targets at 128 tokens on 4 GPUs: <= 30 us each)" in text
    assert "ROWS DIFFER FROM THE NORMAL MODE'S" in text
    assert "COMBINE DIFFERS" not in text
    assert "low-latency mode, eager (no graph): dispatch 50 us, combine 55 us" in text
    table = run.table({"results": rows})
    assert "| 4 | deepseek-v3, uniform | 128 | bf16, low-latency mode | 10 | 25 | 28 | 50 | 55 |" in table
    assert "| FP8 (x_fp8, scales), low-latency mode | 6 | 20 |" in table


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


def test_summary_compares_default_with_the_sweep_and_the_torch_backend_with_nccl() -> None:
    """``run.summary`` reads the default ``num_sm`` against the sweep's best, eager against graph and the
    torch backend against the NCCL per-rank pipeline off the rows of one run."""
    import run

    case = {"gpus": 2, "shape": "deepseek-v3", "routing": "uniform", "tokens": 128}
    rows = [
        {**case, "bench": "triton", "method": "ours-sm20", "dispatch_ms": 0.1, "combine_ms": 0.05},
        {**case, "bench": "triton", "method": "ours-sm132", "dispatch_ms": 0.2, "combine_ms": 0.05,
         "default_num_sm": 132, "dispatch_launches_ms": 0.12, "dispatch_launches_host_ms": 0.09,
         "combine_launches_ms": 0.03, "combine_launches_host_ms": 0.012},
        {**case, "bench": "triton", "method": "ours-graph-sm20", "dispatch_ms": 0.04, "combine_ms": 0.02},
        {**case, "bench": "triton", "method": "ours-graph-sm132", "dispatch_ms": 0.04, "combine_ms": 0.02},
        {**case, "bench": "torch", "method": "torch", "dispatch_ms": 0.5, "combine_ms": 0.3,
         "dispatch_host_ms": 0.4, "combine_host_ms": 0.2, "dispatch_collectives": 2, "dispatch_host_syncs": 1,
         "dispatch_device_ops": 23, "dispatch_cuda_sync_warnings": 0},
        {**case, "bench": "torch", "method": "nccl-dest", "dispatch_ms": 1.0, "combine_ms": 0.3,
         "dispatch_host_ms": 0.9, "combine_host_ms": 0.25, "dispatch_collectives": 3, "dispatch_host_syncs": 4,
         "dispatch_device_ops": 26},
        {**case, "bench": "torch", "method": "torch-fp8", "dispatch_ms": 0.3, "combine_ms": 0.3},
    ]  # fmt: skip
    text = "\n".join(run.summary(rows))
    assert "torch backend FP8 dispatch 300 us vs bf16 500 us: 0.60x" in text
    assert "eager dispatch: default num_sm=132 200 us, best num_sm=20 100 us: default at 50%" in text
    assert "graph combine: default num_sm=132 20 us, best num_sm=20 20 us: default at 100%" in text
    assert "eager dispatch 200 us = 5.0x its graph replay" in text
    assert "launching its kernels one by one (eager_graphs off) 120 us = 3.0x its graph replay; 90 us" in text
    assert (
        "eager combine launching its kernel (eager_graphs off) 30 us = 1.5x its graph replay; 12 us" in text
    )
    assert "torch backend dispatch 500 us vs NCCL per-rank pipeline 1000 us: 0.50x" in text
    assert (
        "torch backend combine 300 us vs NCCL per-rank pipeline 300 us: 1.00x (target <= 1x); host 200 vs 250 us"
        in text
    )
    assert (
        "work per dispatch (collectives, host waits, tensor operations): torch backend 2, 1, 23 vs NCCL per-rank "
        "pipeline 3, 4, 26; synchronizing CUDA calls 0 (torch backend)" in text
    )
    assert "work per combine" not in text  # (not counted in these rows)
    big = {**case, "tokens": 4096, "bench": "triton"}
    rows = [
        {**big, "method": "ours-sm132", "dispatch_ms": 0.25, "dispatch_pct_ce": 80.0, "default_num_sm": 132},
        {**big, "method": "ours-graph-sm132", "dispatch_ms": 0.2, "dispatch_pct_ce": 100.0},
        {**big, "method": "ours-layer-default", "dispatch_ms": 0.4, "dispatch_pct_ce": 50.0},
    ]
    assert run.summary(rows) == [
        "2 GPUs, deepseek-v3 uniform, 4096 tok: eager dispatch 250 us = 80% of the copy engine (target >= 75% "
        "on 2 GPUs); graph 200 us = 100%; the layer as the README builds it 400 us = 50%"
    ]
    # the layer's row with what sets it apart from the backend's own: its backend called directly, int32
    # ids, the same calls again, and how its calls ran
    layer = {**case, "bench": "triton", "method": "ours-layer-default", "dispatch_ms": 0.078,
             "dispatch_host_ms": 0.075, "combine_ms": 0.057, "combine_host_ms": 0.027,
             "backend_dispatch_ms": 0.044, "backend_combine_ms": 0.031, "int32_ids_dispatch_ms": 0.045,
             "int32_ids_combine_ms": 0.03, "repeat_dispatch_ms": 0.077, "repeat_combine_ms": 0.056,
             "graph_replays": 40, "graph_captures": 2, "workspaces_allocated": 2,
             "combine_outputs_allocated": 1}  # fmt: skip
    text = "\n".join(run.summary([layer]))
    assert (
        "128 tok: the layer as the README builds it: eager dispatch 78 us (75 us host); its backend called "
        "directly 44 us, int32 ids 45 us, again 77 us" in text
    )
    assert "eager combine 57 us (27 us host); its backend called directly 31 us" in text
    assert (
        "the layer's calls: 40 graph replays, 2 captures, 2 workspaces, 1 combine outputs allocated" in text
    )


def test_host_speed_reaches_the_rows_and_the_summary() -> None:
    """A case's host record (each rank's Python loop time, the CPU steal over the case) goes into every row
    of the case as the slowest rank's loop and the steal, and the summary names both beside the eager
    rows; cases without one (older results) get neither."""
    import run

    host = {"python_us": [905.4, 1888.6], "graph_replay_us": [3.1, 4.2], "steal_pct": 1.25}
    case = {
        "shape": "deepseek-v3", "routing": "uniform", "tokens": 128, "hidden": 7168, "experts": 256, "topk": 8,
        "nvlink_bytes": 10**6, "default_num_sm": 132, "host": host,
        "results": {"ours-sm132": {"dispatch_ms": 0.05, "combine_ms": 0.04},
                    "ours-graph-sm132": {"dispatch_ms": 0.03, "combine_ms": 0.02}},
    }  # fmt: skip
    raw = {"world_size": 2, "date": None, "commit": None, "cases": [case]}
    rows = run.rows_of(raw, "triton")
    assert [(r["host_python_us"], r["host_steal_pct"]) for r in rows] == [(1888.6, 1.25)] * 2
    text = "\n".join(run.summary(rows))
    assert (
        "128 tok: host: a fixed Python loop 1889 us on the slowest rank as the case started (the eager rows "
        "are bound by host work); CPU steal 1.2% over the case" in text
    )
    del case["host"]
    rows = run.rows_of(raw, "triton")
    assert not any("host_python_us" in r for r in rows)
    assert "host:" not in "\n".join(run.summary(rows))


def test_run_record_cpu_steal(monkeypatch) -> None:
    """``cpu_times`` reads the steal and total ticks of ``/proc/stat``'s first line; ``steal_pct`` the
    steal share since an earlier reading (``None`` without one, or without ``/proc/stat``)."""
    import builtins
    import io

    import run_record

    lines = iter(["cpu  100 0 50 800 0 0 0 50 0 0\n", "cpu  150 0 50 1650 0 0 0 150 0 0\n"])
    real_open = builtins.open
    monkeypatch.setattr(
        builtins,
        "open",
        lambda f, *a, **k: io.StringIO(next(lines)) if f == "/proc/stat" else real_open(f, *a, **k),
    )
    since = run_record.cpu_times()
    assert since == (50, 1000)
    assert run_record.steal_pct(since) == 10.0  # (100 of the 1000 ticks since)
    assert run_record.steal_pct(None) is None
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: (_ for _ in ()).throw(OSError(f)))
    assert run_record.cpu_times() is None


def test_table_renders_the_page_rows() -> None:
    """``run.table`` gives the benchmarks page's markdown table: one row per case, the default
    ``num_sm``'s graph and eager times, the layer's defaults, the torch backend and NCCL, % of the copy
    engine at 4096 tokens; then the case's FP8 rows (the tuple, and bf16 rows quantized in the send
    kernel): their own bytes' copy engine, % of it and the time over bf16 dispatch."""
    import run

    case = {"gpus": 2, "shape": "deepseek-v3", "routing": "uniform", "tokens": 4096}
    rows = [
        {**case, "bench": "triton", "method": "ce", "copy_ms": 0.1},
        {**case, "bench": "triton", "method": "ours-graph-sm132", "dispatch_ms": 0.2, "combine_ms": 0.25,
         "default_num_sm": 132},
        {**case, "bench": "triton", "method": "ours-sm132", "dispatch_ms": 0.4, "combine_ms": 0.5},
        {**case, "bench": "triton", "method": "ours-layer-default", "dispatch_ms": 0.5, "combine_ms": 0.5},
        {**case, "bench": "torch", "method": "torch", "dispatch_ms": 1.0, "combine_ms": 2.0},
        {**case, "bench": "torch", "method": "nccl-dest", "dispatch_ms": 2.0, "combine_ms": 4.0},
        {**case, "bench": "torch", "method": "torch-fp8", "dispatch_ms": 0.8, "combine_ms": 2.0},
        {**case, "bench": "triton", "method": "ce-fp8", "copy_ms": 0.06},
        {**case, "bench": "triton", "method": "ours-fp8-graph-sm132", "dispatch_ms": 0.12, "combine_ms": 0.25,
         "quantize_dispatch_ms": 0.125},
        {**case, "bench": "triton", "method": "ours-fp8-sm132", "dispatch_ms": 0.3, "combine_ms": 0.5,
         "quantize_dispatch_ms": 0.32},
    ]  # fmt: skip
    lines = run.table({"results": rows}).splitlines()
    assert len(lines) == 5
    assert lines[2] == (
        "| 2 | deepseek-v3, uniform | 4096 | bf16 | 100 | 200 (50 %) | 250 (40 %) | 400 (25 %) | 500 (20 %) | "
        "500 (20 %) / 500 (20 %) | 1000 (10 %) / 2000 (5 %) | 2000 (5 %) / 4000 (2 %) |"
    )
    assert lines[3] == (
        "| 2 | deepseek-v3, uniform | 4096 | FP8 (x_fp8, scales) | 60 | 120 (50 %, 0.60x) | 250 (40 %) | "
        "300 (20 %, 0.75x) | 500 (20 %) | - | 800 / 2000 | - |"
    )
    assert lines[4] == (
        "| 2 | deepseek-v3, uniform | 4096 | bf16, fp8=True | 60 | 125 (48 %, 0.62x) | - | 320 (19 %, 0.80x) | - "
        "| - | - | - |"
    )
    # a case without FP8 rows has only its bf16 row
    assert len(run.table({"results": rows[:6]}).splitlines()) == 3


def test_fp8_rows_count_their_own_bytes() -> None:
    """FP8 dispatch rows: their bytes are the FP8 rows and scales, their dispatch's share is of the copy
    engine copying those bytes (``ce-fp8``), their combine's of the bf16 ceiling; the summary compares FP8
    with bf16 dispatch, graph and eager, quantize-on-send included."""
    import run

    raw = {
        "world_size": 2, "date": None, "commit": None,
        "cases": [
            {
                "shape": "deepseek-v3", "routing": "uniform", "tokens": 4096, "hidden": 7168, "topk": 8,
                "experts": 256, "default_num_sm": 132, "nvlink_bytes": 2000, "nvlink_bytes_fp8": 1031,
                "results": {
                    "ce": {"copy_ms": 0.1},
                    "ce-fp8": {"copy_ms": 0.06},
                    "ours-sm132": {"dispatch_ms": 0.4, "combine_ms": 0.5},
                    "ours-graph-sm132": {"dispatch_ms": 0.2, "combine_ms": 0.25},
                    "ours-fp8-sm132": {"dispatch_ms": 0.3, "combine_ms": 0.5, "quantize_dispatch_ms": 0.32},
                    "ours-fp8-graph-sm132": {"dispatch_ms": 0.12, "combine_ms": 0.25, "quantize_dispatch_ms": 0.13},
                },
            }
        ],
    }  # fmt: skip
    rows = {r["method"]: r for r in run.rows_of(raw, "triton")}
    g = rows["ours-fp8-graph-sm132"]
    assert (g["nvlink_bytes"], g["dispatch_pct_ce"], g["combine_pct_ce"]) == (1031, 50, 40)
    assert rows["ours-graph-sm132"]["nvlink_bytes"] == 2000
    text = "\n".join(run.summary(list(rows.values())))
    assert (
        "Triton graph FP8 dispatch 120 us vs bf16 200 us: 0.60x, 50% of the copy engine for its bytes" in text
    )
    assert (
        "Triton graph FP8 dispatch of bf16 rows, fp8=True (quantized in the send kernel) 130 us: 0.65x bf16"
        in text
    )
    assert "Triton eager FP8 dispatch 300 us vs bf16 400 us: 0.75x" in text


def test_rounds_rows_keep_medians_and_each_round() -> None:
    """The Triton bench's interleaved rounds: each round visits every configuration once, the order
    rotating so that each takes every place once; a configuration's row holds the median over the
    rounds of every time, the last round's flags and counters, each round's value of the fields the
    summary pairs, and the number of rounds."""
    import bench_triton as bench
    import pytest

    sms = [20, 32, 66, 132]
    orders = [bench.rotated(sms, r) for r in range(len(sms))]
    assert orders[0] == sms
    assert orders[1] == [32, 66, 132, 20]
    assert all(sorted(o) == sms for o in orders)
    assert [sorted(o[i] for o in orders) for i in range(len(sms))] == [sms] * len(sms)
    assert bench.rotated(sms, 5) == orders[1]
    rounds = [
        {"dispatch_ms": 0.05, "combine_ms": 0.03, "dispatch_ms_lead": 0.03, "dispatch_launches_ms": 0.07,
         "overlap_exact": False, "graph_replays": 10},
        {"dispatch_ms": 0.09, "combine_ms": 0.02, "dispatch_ms_lead": 0.04, "dispatch_launches_ms": 0.08,
         "overlap_exact": True, "graph_replays": 20},
        {"dispatch_ms": 0.04, "combine_ms": 0.04, "dispatch_ms_lead": 0.02, "dispatch_launches_ms": 0.06,
         "overlap_exact": True, "graph_replays": 30},
    ]  # fmt: skip
    row = bench.over_rounds(rounds)
    assert (row["dispatch_ms"], row["combine_ms"], row["dispatch_ms_lead"]) == (0.05, 0.03, 0.03)
    assert (row["overlap_exact"], row["graph_replays"], row["rounds"]) == (True, 30, 3)
    assert row["dispatch_ms_rounds"] == [0.05, 0.09, 0.04]
    assert row["combine_ms_rounds"] == [0.03, 0.02, 0.04]
    assert row["dispatch_launches_ms_rounds"] == [0.07, 0.08, 0.06]
    assert "combine_launches_ms_rounds" not in row
    assert "dispatch_ms_lead_rounds" not in row
    with pytest.raises(ValueError, match="rounds"):
        bench.over_rounds([])


def test_summary_pairs_the_rounds() -> None:
    """Rows measured in the same rounds are compared round by round: the default ``num_sm`` against the
    best of the sweep and eager against graph are the medians of the rounds' ratios (a host that is slow
    in some rounds moves both sides of a ratio alike), where the ratio of the medians would mislead;
    ``rows_of`` keeps each round's times and the torch rows' paired ratios in the results rows."""
    import run

    case = {"shape": "deepseek-v3", "routing": "uniform", "tokens": 128, "hidden": 7168, "experts": 256,
            "topk": 8, "nvlink_bytes": 10**6, "default_num_sm": 132}  # fmt: skip
    # rounds 3-5 (eager) / 4-5 (graph) in the host's slow state: every round's sm66 takes 0.95x the default
    fast_slow = [0.04, 0.04, 0.08, 0.08, 0.08]
    sm66 = [0.95 * t for t in [0.04, 0.04, 0.04, 0.08, 0.08]]
    eager_default = {"dispatch_ms": 0.08, "combine_ms": 0.1, "dispatch_ms_rounds": fast_slow,
                     "combine_ms_rounds": [0.06, 0.06, 0.1, 0.1, 0.1], "dispatch_launches_ms": 0.12,
                     "dispatch_launches_ms_rounds": [0.09, 0.09, 0.09, 0.15, 0.15], "rounds": 5}  # fmt: skip
    raw = {
        "world_size": 2, "date": None, "commit": None,
        "cases": [{**case, "results": {
            "ours-sm66": {"dispatch_ms": 0.038, "combine_ms": 0.1, "dispatch_ms_rounds": sm66,
                          "combine_ms_rounds": [0.1] * 5, "rounds": 5},
            "ours-sm132": eager_default,
            "ours-graph-sm66": {"dispatch_ms": 0.03, "combine_ms": 0.03},
            "ours-graph-sm132": {"dispatch_ms": 0.03, "combine_ms": 0.03,
                                 "dispatch_ms_rounds": [0.02, 0.02, 0.04, 0.03, 0.03],
                                 "combine_ms_rounds": [0.03, 0.03, 0.03, 0.05, 0.05]},
        }}],
    }  # fmt: skip
    rows = run.rows_of(raw, "triton")
    by = {r["method"]: r for r in rows}
    assert by["ours-sm132"]["dispatch_ms_rounds"] == fast_slow
    assert by["ours-sm132"]["rounds"] == 5
    assert by["ours-sm132"]["dispatch_launches_ms_rounds"] == [0.09, 0.09, 0.09, 0.15, 0.15]
    text = "\n".join(run.summary(rows))
    # medians 38 against 80 us would read 48%; each round says 95%
    assert (
        "eager dispatch: default num_sm=132 80 us, best num_sm=66 38 us: default at 95% of the best's speed"
        in text
    )
    # a row without rounds: the ratio of the figures (a tie: the first of the sweep)
    assert "graph dispatch: default num_sm=132 30 us, best num_sm=66 30 us: default at 100%" in text
    # eager over graph per round: 2, 2, 2, 2.67, 2.67 (medians: 2.7x); combine 2, 2, 3.33, 2, 2 (3.3x)
    assert "eager dispatch 80 us = 2.0x its graph replay (target <= 2x)" in text
    assert "eager combine 100 us = 2.0x its graph replay (target <= 2x)" in text
    # launches over graph per round: 4.5, 4.5, 2.25, 5, 5
    assert "eager dispatch launching its kernels one by one (eager_graphs off) 120 us = 4.5x" in text
    # rows of other rounds (another count) are not paired: the ratio of the figures
    one_off = {**by["ours-graph-sm132"], "dispatch_ms_rounds": [0.03] * 4}
    assert run.paired_ratio(by["ours-sm132"], "dispatch_ms", one_off, "dispatch_ms") == 0.08 / 0.03
    # the torch bench's rows: each round's times and the paired ratios reach the rows and the summary
    torch_raw = {
        "world_size": 2, "date": None, "commit": None,
        "cases": [{**case, "results": {
            "torch": {"dispatch_ms": 1.0, "combine_ms": 0.2, "dispatch_ms_rounds": [1.0, 0.9, 1.1],
                      "dispatch_vs_nccl_dest": 1.1, "combine_vs_nccl_dest": 0.9},
            "nccl-dest": {"dispatch_ms": 0.8, "combine_ms": 0.2},
        }}],
    }  # fmt: skip
    trows = run.rows_of(torch_raw, "torch")
    assert trows[0]["dispatch_ms_rounds"] == [1.0, 0.9, 1.1]
    assert trows[0]["dispatch_vs_nccl_dest"] == 1.1
    text = "\n".join(run.summary(trows))
    assert "torch backend dispatch 1000 us vs NCCL per-rank pipeline 800 us: 1.10x" in text
    assert "torch backend combine 200 us vs NCCL per-rank pipeline 200 us: 0.90x" in text
