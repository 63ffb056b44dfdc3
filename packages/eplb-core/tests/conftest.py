"""Shared pytest setup of the eplb-core tests."""

from __future__ import annotations

import fcntl

import pytest


@pytest.fixture(scope="session")
def compiled_planner(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The compiled planner of every mode in this process (``eplb_core.warmup``), for the tests that call it.

    Compiling it takes about two minutes of a CPU core. The first test process that needs it compiles it into
    Numba's disk cache; pytest-xdist's other workers wait on a lock beside their temporary folders and then
    load it from there, instead of compiling it once more beside the first.
    """
    from eplb_core import warmup

    lock_path = tmp_path_factory.getbasetemp().parent / "eplb-core-compiled-planner.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        assert warmup.main() == 0
