"""The Triton kernels compiled for sm_90 without a GPU (``benchmarks/offline_compile.py``): no CTA
barrier inside the tile loops of a large layer's dispatch and combine kernels, and the epoch words
polled with acquire loads and pushed with relaxed stores (the GPU path, which the interpreter skips).

A barrier there is paid once per tile of every chunk. Between ``cd8c480`` and ``056468a`` the
combine's per-tile test of which tokens have a slot on each peer was such a barrier (a reduction in the
int64 load's register layout): 8 % slower at 4096 tokens on 2x H100, invisible to the correctness tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "offline_compile.py"
LARGE = ["--world", "2", "--tokens", "4096", "--backend-tiles"]


def _run_tool(args: list[str]) -> str:
    """stdout of ``offline_compile.py args``, which must succeed; it compiles the real kernels, so not
    under the interpreter this session runs the other tests with."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(TOOL), *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(
            [*LARGE, "--num-sm", "132", "--split", "44", "--steal", "--pdl"], id="W2-T4096-SM132-split"
        ),
        pytest.param([*LARGE, "--num-sm", "32"], id="W2-T4096-SM32"),
        pytest.param(
            ["--world", "8", "--tokens", "4096", "--backend-tiles", "--num-sm", "132", "--split", "44"],
            id="W8-T4096-SM132-split",
        ),
    ],
)
def test_no_cta_barrier_in_tile_loops(args: list[str]) -> None:
    out = _run_tool([*args, "--check-tile-loops"])
    # the check saw the tile loops: every dispatch and combine variant has some, all without a barrier
    found = re.findall(r"^(dispatch|combine) .* tile-loop-barriers=\[([0-9, ]*)\]$", out, re.M)
    assert {k for k, _ in found} == {"dispatch", "combine"}, out
    for kernel, counts in found:
        assert counts, f"{kernel}: no tile loop found"
        assert set(counts.split(", ")) == {"0"}, f"{kernel}: {counts}"


@pytest.mark.slow
def test_epoch_words_use_acquire_loads_and_relaxed_stores(tmp_path: Path) -> None:
    # on a GPU the epoch-tagged words are polled with loads and pushed with stores (inline PTX): the
    # interpreter only ever runs the atomic fallbacks, so only the compiled code shows which path is taken
    args = ["--world", "2", "--tokens", "128", "--backend-tiles", "--num-sm", "132", "--pdl"]
    _run_tool([*args, "--dump", str(tmp_path)])
    ptx = {p.name.split("-", 1)[1][:-4]: p.read_text() for p in tmp_path.glob("*.ptx")}
    assert "st.relaxed.sys.global.b64" in ptx["layout"], "layout: counts not pushed with relaxed stores"
    assert not re.search(r"atom\.global\.sys\.[a-z.]*exch", ptx["layout"]), (
        "layout: a push is still an exchange"
    )
    counts = ptx["counts"]
    assert "ld.acquire.sys.global.b64" in counts, "counts: no acquire-load poll"
    assert "st.relaxed.sys.global.b64" in counts, "counts: base rows not pushed with relaxed stores"
    assert not re.search(r"atom\.global\.sys\.acquire", counts), "counts: still polls with atomics"
