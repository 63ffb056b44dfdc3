"""Bad input, misuse and faults: clear errors, nothing hangs (gloo, spawned by the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ep_a2a.testing import run_local

CASES = str(Path(__file__).with_name("_cases.py"))

EXPECTED = [
    "construct-local",
    "mismatch",
    "dispatch-args",
    "combine-args",
    "static-mode",
    "scatter-perm",
    "finalize",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [pytest.param(2, id="gloo-2"), pytest.param(3, id="gloo-3")])
def test_errors_and_faults(world: int) -> None:
    seen = run_local(f"{CASES}:run_errors", world, timeout_s=110)
    for rank in range(world - 1):
        assert seen[rank] == [*EXPECTED, "late-rank", "early-exit"], (rank, seen[rank])
    assert seen[world - 1] == [*EXPECTED, "exited"]
