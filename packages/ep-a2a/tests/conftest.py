"""Shared pytest setup of the ep-a2a tests."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The ranks of the distributed tests are forked from this process (ep_a2a.testing.run_local): importing
# the torch backend here (it imports torch._dynamo, seconds of CPU) spares every rank of every test.
import ep_a2a.backends.torch  # noqa: F401

# The benchmark scripts import one another by name (run as scripts, their folder is on sys.path); the
# tests of their helpers import them the same way. Processes started by ep_a2a.testing inherit the path.
BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)


def pytest_configure(config: pytest.Config) -> None:
    # CI bounds the distributed CPU tests with pytest-timeout; machines without the plugin (the GPU image)
    # still accept the marker under --strict-markers (the tests bound their own processes as well).
    config.addinivalue_line(
        "markers", "timeout(seconds): fail the test after that many seconds (pytest-timeout)"
    )
