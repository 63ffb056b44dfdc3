"""The Triton kernel variants the backend may launch, compiled for sm_90 without a GPU
(``tests/sm90_compile.py``), for the configurations the backend picks: every variant of the default
decode-sized layer; for large layers at the default ``num_sm`` and at a whole H100/H200, 2 and 8 ranks,
and remote peers, every kernel (of the row kernels' variants, those with weights).

Also checked in the compiled code (the interpreter never runs it): no CTA barrier inside the tile loops
of a large layer's dispatch and combine kernels (one would be paid per tile of every chunk), the
epoch words polled with acquire loads and pushed with relaxed stores, and every poll of epoch words
followed by a load of them again. The last one is a race the interpreter cannot show (it runs one copy
of each value): a tensor of words smaller than the CTA is held by several threads each, every copy
loaded on its own, and the poll's exit is decided by a reduction over one copy; a thread whose copy was
loaded just before a peer's word landed would otherwise go on with the word of the call two before (on
two GPUs: rows copied from the wrong slots, counts and combine sums of an earlier call, a peer named
late although it signalled).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

TOOL = Path(__file__).resolve().parent / "sm90_compile.py"
#: the barrier check holds for the Triton line of the GPU machines' image (3.6), whose code the published
#: figures measure; Triton 3.9 compiles the same kernels with CTA barriers in the combine's tile loops
GPU_IMAGE_TRITON = triton.__version__.startswith("3.6.")

pytestmark = pytest.mark.slow


def _run_tool(args: list[str]) -> str:
    """stdout of ``sm90_compile.py args``, which must succeed; it compiles the real kernels, so not
    under the interpreter this session runs the other tests with."""
    # (nor with Triton's FP-fusion variables, which would hide its warning on a variant left to its default)
    drop = ("TRITON_INTERPRET", "TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    run = subprocess.run(
        [sys.executable, str(TOOL), *args], env=env, capture_output=True, text=True, timeout=1200
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _compiled(out: str) -> dict[str, int]:
    """Variants compiled per kernel."""
    kinds: dict[str, int] = {}
    for line in out.splitlines()[1:]:
        kinds[line.split()[0]] = kinds.get(line.split()[0], 0) + 1
    return kinds


@pytest.mark.parametrize(
    ("args", "tiled"),
    [
        pytest.param(["--world", "2", "--tokens", "4096", "--num-sm", "132"], True, id="W2-T4096-SM132"),
        pytest.param(["--world", "2", "--tokens", "4096", "--num-sm", "20"], True, id="W2-T4096-SM20"),
        pytest.param(
            ["--world", "8", "--tokens", "4096", "--num-sm", "132", "--split", "44"],
            True,
            id="W8-T4096-SM132-split",
        ),
        pytest.param(
            ["--world", "4", "--node", "2", "--tokens", "256", "--num-sm", "32"], False, id="W4-remote"
        ),
    ],
)
def test_every_variant_compiles(args: list[str], tiled: bool) -> None:
    check = ["--check-spin-reload", *(["--check-tile-loops"] if tiled and GPU_IMAGE_TRITON else [])]
    out = _run_tool([*args, "--quick", *check])
    kinds = _compiled(out)
    remote = "--node" in args
    want = {"layout", "counts", "dispatch", "combine", "barrier"} | ({"pack", "expand"} if remote else set())
    assert set(kinds) == want, out
    # the row kernel with and without the receive layout (and its rewrite / mirror variants); combine in
    # the row dtype, float32 and 1-wide rows
    assert kinds["dispatch"] >= (1 if remote else 4)
    assert kinds["combine"] == 3 * (2 if remote else 1)
    if (
        tiled and GPU_IMAGE_TRITON
    ):  # the check saw the tile loops: every dispatch and combine variant has some, none a barrier
        found = re.findall(
            r"^(dispatch|combine) .* tile-loop-barriers=\[([0-9, ]*)\] spin-reloads=\[[A-Za-z, ]*\]$",
            out,
            re.M,
        )
        assert {k for k, _ in found} == {"dispatch", "combine"}, out
        assert any(counts for _, counts in found), "no tile loop found"


def test_decode_layer_every_variant_and_epoch_words(tmp_path: Path) -> None:
    """The default layer at decode size (``TritonTuning()`` on an H200: 132 SMs, 128 tokens): every
    variant, and the epoch words' loads and stores."""
    # on a GPU the epoch-tagged words are polled with loads and pushed with stores (inline PTX): the
    # interpreter only ever runs the atomic fallbacks, so only the compiled code shows which path is taken
    out = _run_tool(
        ["--world", "2", "--tokens", "128", "--num-sm", "132", "--dump", str(tmp_path), "--check-spin-reload"]
    )
    kinds = _compiled(out)
    # the counts kernel waits for every source's counts, the row kernel for its peers' start and base rows
    assert re.search(r"^counts .* spin-reloads=\[True\]$", out, re.M), out
    assert set(kinds) == {"layout", "counts", "dispatch", "combine", "barrier"}
    assert kinds["dispatch"] == 16  # weights or not, caller scatter or not, x 4 row-kernel variants
    ptx = {p.name.split("-", 1)[1][:-4]: p.read_text() for p in tmp_path.glob("*.ptx")}
    assert "st.relaxed.sys.global.b64" in ptx["layout"], "layout: counts not pushed with relaxed stores"
    assert not re.search(r"atom\.global\.sys\.[a-z.]*exch", ptx["layout"]), (
        "layout: a push is still an exchange"
    )
    counts = ptx["counts"]
    assert "ld.acquire.sys.global.b64" in counts, "counts: no acquire-load poll"
    assert "st.relaxed.sys.global.b64" in counts, "counts: base rows not pushed with relaxed stores"
    assert not re.search(r"atom\.global\.sys\.acquire", counts), "counts: still polls with atomics"


@pytest.mark.parametrize("tokens", [4096, 128], ids=["T4096-tiled", "T128-decode"])
def test_fp8_layer_every_variant_compiles(tokens: int) -> None:
    """A layer of FP8 rows (``dtype=torch.float8_e4m3fn``, DeepSeek-V3 width) on an H200, as
    ``use_aot`` compiles it: the row kernel on packed FP8 rows (int16 elements, 3696 per row), on bf16
    rows it quantizes to them on send, and on raw float8 rows, combine in bf16 and float32. In the tiled
    layer every packed-row and quantizing variant's tile loops move 16-byte vectors, without a CTA
    barrier."""
    tiled = tokens > 1024
    check = ["--check-tile-loops"] if tiled and GPU_IMAGE_TRITON else []
    out = _run_tool(["--fp8", "--world", "2", "--tokens", str(tokens), "--num-sm", "132", "--quick", *check])
    kinds = _compiled(out)
    assert set(kinds) == {"layout", "counts", "dispatch", "combine", "barrier"}, out
    packed = re.findall(
        r"^dispatch .*torch\.int16, \(torch\.int16.*, 3696\) .* tile-loop-barriers=\[([0-9, ]*)\] spin-reloads=\[[A-Za-z, ]*\]$",
        out,
        re.M,
    )
    assert len(packed) == 4, out  # merged, counts launch, rewrite, mirror (with weights)
    quantized = re.findall(
        r"^dispatch .*torch\.int16, \(torch\.bfloat16.*, 3696\) .* tile-loop-barriers=\[([0-9, ]*)\] spin-reloads=\[[A-Za-z, ]*\]$",
        out,
        re.M,
    )
    assert len(quantized) == 4, out
    assert len(re.findall(r"^dispatch .*torch\.float8_e4m3fn.*, 7168\) ", out, re.M)) == 4, out
    assert re.search(r"^combine .*torch\.bfloat16", out, re.M), out
    if tiled and GPU_IMAGE_TRITON:
        assert all(counts for counts in packed), "a packed-row variant without 16-byte tile loops"
        assert all(counts for counts in quantized), "a quantizing variant without 16-byte tile loops"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-layer", "fp8-layer"])
def test_low_latency_kernels_compile(fp8: bool) -> None:
    """The low-latency mode's kernels (``TritonTuning(low_latency=True)``) on 4 ranks of an H200 at
    decode size, DeepSeek-V3 width: dispatch of the layer's rows, of packed FP8 rows and of bf16 rows
    quantized on send, and the bf16 combine. Each polls its epoch words once and loads them again after."""
    args = [
        "--low-latency",
        "--world",
        "4",
        "--tokens",
        "128",
        "--num-sm",
        "132",
        *(["--fp8"] if fp8 else []),
        "--check-spin-reload",
    ]
    out = _run_tool(args)
    lines = out.splitlines()[1:]
    assert all(ln.endswith("spin-reloads=[True]") for ln in lines), out
    kinds = [ln.split()[0] for ln in lines]
    assert kinds.count("ll_dispatch") == (2 if fp8 else 3), out
    assert kinds.count("ll_combine") == 1, out
    packed = [ln for ln in lines if "torch.int16, 3696" in ln]  # packed FP8 rows (7168 + 4 * 56 bytes)
    assert any("((torch.int16, True)" in ln for ln in packed), out  # moved as they are
    assert any("((torch.bfloat16, True)" in ln for ln in packed), out  # bf16 rows quantized on send
