"""Placement (validate, diff, save/load), loaders/exporters, load history and the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eplb_core as E
from eplb_core import cli, demo, io

KW = {"num_replicas": 40, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}


@pytest.fixture
def placement() -> E.Placement:
    return E.plan(E.synthetic_loads(4, 32, num_groups=4, seed=2), **KW)


def _clone_with(p: E.Placement, phy2log: torch.Tensor, logcnt: torch.Tensor | None = None) -> E.Placement:
    return E.Placement.from_tensors(
        phy2log, p.weight, num_groups=4, num_nodes=2, num_gpus=8, mode=p.mode, logcnt=logcnt
    )


def test_validate_catches_corruption(placement: E.Placement) -> None:
    placement.validate()
    broken = placement.phy2log.clone()
    # drop an expert entirely: give its only replica to another expert
    single = int(torch.nonzero(placement.logcnt[0] == 1)[0])
    broken[0][broken[0] == single] = (single + 1) % 32
    with pytest.raises(ValueError, match="no replica"):
        _clone_with(placement, broken).validate()
    # move one group's replica to the other node (breaks the strict hierarchy)
    swapped = placement.phy2log.clone()
    a, b = swapped[0, 0].item(), swapped[0, -1].item()
    swapped[0, 0], swapped[0, -1] = b, a
    with pytest.raises(ValueError, match="strict mode"):
        _clone_with(placement, swapped).validate()
    # a stale logcnt
    with pytest.raises(ValueError, match="logcnt"):
        _clone_with(placement, placement.phy2log, placement.logcnt.roll(1, dims=1)).validate()


def test_from_tensors_rejects_an_expert_without_replica(placement: E.Placement) -> None:
    broken = placement.phy2log.clone()
    broken[broken == 0] = 1  # expert 0 loses every replica
    with pytest.raises(ValueError, match="no replica"):
        _clone_with(placement, broken)
    with pytest.raises(ValueError, match="no replica"):
        _clone_with(placement, placement.phy2log, torch.zeros_like(placement.logcnt))
    with pytest.raises(ValueError, match="phy2log must hold integer"):
        _clone_with(placement, placement.phy2log.to(torch.float64))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param({"phy2log": torch.zeros(4, 40, dtype=torch.int64) + 99}, "expert id", id="ids"),
        pytest.param({"logcnt": torch.ones(4, 31, dtype=torch.int64)}, "logcnt", id="logcnt-shape"),
        pytest.param({"logcnt": torch.ones(4, 32)}, "logcnt must hold integers", id="logcnt-float"),
        pytest.param({"num_gpus": 7}, "num_gpus", id="gpus"),
        pytest.param({"weight": torch.full((4, 32), float("nan"))}, "NaN", id="nan-weight"),
    ],
)
def test_gpu_loads_of_names_the_bad_argument(placement: E.Placement, change: dict, match: str) -> None:
    args = {
        "weight": placement.weight,
        "phy2log": placement.phy2log,
        "logcnt": placement.logcnt,
        "num_gpus": 8,
    }
    with pytest.raises(ValueError, match=match):
        E.gpu_loads_of(**{**args, **change})


def test_diff_and_bytes(placement: E.Placement) -> None:
    same = placement.diff(placement, bytes_per_expert=1000)
    assert same.fraction_changed == 0.0
    assert same.bytes_to_move == 0
    other = E.plan(E.synthetic_loads(4, 32, num_groups=4, seed=3), **KW)
    d = other.diff(placement, bytes_per_expert=1000)
    assert int(d.num_changed.sum()) == int((other.phy2log != placement.phy2log).sum())
    assert d.bytes_to_move == 1000 * int(d.num_changed.sum())
    with pytest.raises(ValueError, match="previous"):
        placement.diff(torch.zeros(1, 3, dtype=torch.int64))


def test_save_load_roundtrip(placement: E.Placement, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    placement.save(path)
    back = E.Placement.load(path)
    assert torch.equal(back.phy2log, placement.phy2log)
    assert torch.equal(back.log2phy, placement.log2phy)
    assert torch.allclose(back.balancedness, placement.balancedness)
    back.validate()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="path"):
        E.Placement.load(tmp_path / "bad.json")


def test_sglang_export(placement: E.Placement, tmp_path: Path) -> None:
    io.save_sglang(placement, tmp_path / "loc.json")
    data = json.loads((tmp_path / "loc.json").read_text())
    assert list(data) == ["physical_to_logical_map"]
    assert data["physical_to_logical_map"] == placement.phy2log.tolist()
    io.save_sglang(placement, tmp_path / "loc.pt")
    assert torch.equal(
        torch.load(tmp_path / "loc.pt", weights_only=True)["physical_to_logical_map"], placement.phy2log
    )


@pytest.mark.parametrize("fmt", ["sglang-json", "sglang-pt", "tensor-pt", "npy", "npz", "csv", "list-json"])
def test_loaders(fmt: str, tmp_path: Path) -> None:
    w = E.synthetic_loads(3, 16, num_groups=4, seed=4)
    w[0] = 0
    if fmt == "sglang-json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps({"logical_count": w.tolist()}))
    elif fmt == "sglang-pt":
        path = tmp_path / "d.pt"
        torch.save({"logical_count": w}, path)
    elif fmt == "tensor-pt":
        path = tmp_path / "t.pt"
        torch.save(w, path)
    elif fmt == "npy":
        path = tmp_path / "d.npy"
        np.save(path, w.numpy())
    elif fmt == "npz":
        path = tmp_path / "d.npz"
        np.savez(path, loads=w.numpy())
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        np.savetxt(path, w.numpy(), delimiter=",")
    else:
        path = tmp_path / "l.json"
        path.write_text(json.dumps(w.tolist()))
    got = io.load_loads(path)
    torch.testing.assert_close(got, w)
    assert io.zero_layers(got) == [0]


def test_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        io.load_loads(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(ValueError, match="logical_count"):
        io.load_loads(tmp_path / "x.json")
    (tmp_path / "x.txt").write_text("1")
    with pytest.raises(ValueError, match="extension"):
        io.load_loads(tmp_path / "x.txt")


def test_physical_to_logical_load() -> None:
    p = E.plan(E.synthetic_loads(2, 16, num_groups=4, seed=1), **{**KW, "num_replicas": 24})
    phys = torch.rand(2, 24, dtype=torch.float64)
    logical = io.physical_to_logical_load(phys, p.phy2log)
    assert logical.shape == (2, 16)
    torch.testing.assert_close(logical.sum(1), phys.sum(1))
    hist = io.physical_to_logical_load(phys.expand(3, -1, -1), p.phy2log)
    assert hist.shape == (3, 2, 16)


def test_expected_load() -> None:
    h = E.synthetic_loads(2, 16, num_groups=4, num_windows=5, seed=1)
    mean = E.expected_load(h, method="mean")
    torch.testing.assert_close(mean.sum(1), h.sum(-1).mean(0))
    ema = E.expected_load(h, halflife=0.01)  # shares of the last window alone, scaled to the mean total
    torch.testing.assert_close(ema / ema.sum(1, keepdim=True), h[-1] / h[-1].sum(1, keepdim=True))
    torch.testing.assert_close(ema.sum(1), h.sum(-1).mean(0))
    one = E.expected_load(h[:1])
    torch.testing.assert_close(one, h[0])
    with pytest.raises(ValueError, match="history"):
        E.expected_load(h[0])
    with pytest.raises(ValueError, match="method"):
        E.expected_load(h, method="median")
    p = E.plan_from_history(h, num_replicas=24, num_groups=4, num_nodes=2, num_gpus=8)
    p.validate()


@pytest.mark.usefixtures("compiled_planner")
def test_cli_plan_compare_and_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--demo", "-o", str(out), "--sglang", str(tmp_path / "s.json")]) == 0
    text = capsys.readouterr().out
    assert "all layers (mean)" in text
    assert "zero load" in text
    prev = E.Placement.load(out)
    loads = tmp_path / "loads.npy"
    np.save(loads, cli.demo_history()[-1].numpy())
    assert (
        cli.main(
            [
                "plan",
                str(loads),
                "--replicas",
                "288",
                "--groups",
                "8",
                "--nodes",
                "4",
                "--gpus",
                "32",
                "--previous",
                str(out),
                "--max-moves",
                "20",
            ]
        )
        == 0
    )
    assert prev.num_layers == 12
    assert cli.main(["compare", "--demo"]) == 0
    assert "greedy" in capsys.readouterr().out
    assert cli.main(["plan", str(loads), "--replicas", "7", "--gpus", "32"]) == 2
    assert "num_replicas" in capsys.readouterr().err
    assert demo.main() == 0


def test_cli_plot(tmp_path: Path) -> None:
    """With the plot extra: a PNG is written; without it: a clear exit message, not a traceback."""
    png = tmp_path / "h.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert cli.main(["plan", "--demo", "--plot", str(png)]) == 2
        return
    assert cli.main(["plan", "--demo", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"eplb-core {E.__version__}"


def test_cli_without_rich_prints_install_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)  # import rich raises ImportError
    assert cli.main(["plan", "--demo"]) == 1
    err = capsys.readouterr().err
    assert "pip install 'eplb-core[cli]'" in err
    assert "Traceback" not in err


def _bad_cli_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments, a word the one-line error must contain)."""
    topo = ["--replicas", "288", "--groups", "8", "--nodes", "4", "--gpus", "32"]
    (tmp / "truncated.npy").write_bytes(b"\x93NUMPY\x01\x00v\x00{'descr'")
    (tmp / "empty.json").write_text("")
    (tmp / "bad.json").write_text("{not json")
    (tmp / "keys.json").write_text('{"other": [[1, 2]]}')
    (tmp / "loads.txt").write_text("1,2,3")
    (tmp / "garbage.pt").write_bytes(b"not a torch file")
    (tmp / "prev.json").write_text('{"format": "eplb-core/placement-v1", "phy2log": [[0]]}')
    np.save(tmp / "loads.npy", cli.demo_history()[-1].numpy())
    return [
        (["plan", str(tmp / "missing.json"), *topo], "missing.json"),
        (["plan", str(tmp / "truncated.npy"), *topo], "truncated.npy"),
        (["plan", str(tmp / "empty.json"), *topo], "empty.json"),
        (["plan", str(tmp / "bad.json"), *topo], "bad.json"),
        (["plan", str(tmp / "keys.json"), *topo], "keys.json"),
        (["plan", str(tmp / "loads.txt"), *topo], "extension"),
        (["plan", str(tmp / "garbage.pt"), *topo], "garbage.pt"),
        (["plan", str(tmp / "loads.npy"), *topo, "--previous", str(tmp / "prev.json")], "prev.json"),
        (["plan", str(tmp / "loads.npy"), *topo, "--previous", str(tmp / "missing.json")], "missing.json"),
        (["plan", "--demo", "-o", str(tmp / "no" / "such" / "plan.json")], "folder"),
        (["compare", "--demo", "--replicas", "288", "--groups", "3", "--gpus", "32"], "num_groups"),
        (["plan", str(tmp / "loads.npy"), "--replicas", "288", "--gpus", "7"], "num_gpus"),
        (["plan"], "LOADS"),
    ]


def test_cli_bad_input_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, word in _bad_cli_inputs(tmp_path):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err
        assert len(err.splitlines()) == 1, err
        assert err.startswith("eplb: error:"), err
        assert word in err, (argv, err)


def test_public_namespace_is_the_api() -> None:
    assert sorted(dir(E)) == sorted(E.__all__)
    for name in ("version", "PackageNotFoundError"):
        assert name not in E.__all__
        assert not hasattr(E, name)
    for name in E.__all__:
        assert getattr(E, name) is not None


@pytest.mark.usefixtures("compiled_planner")
def test_warmup_plans_every_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from eplb_core import warmup

    assert warmup.main() == 0
    assert "planner ready" in capsys.readouterr().out
