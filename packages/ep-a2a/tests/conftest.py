"""Shared pytest setup of the ep-a2a tests."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # CI bounds the distributed CPU tests with pytest-timeout; machines without the plugin (the GPU image)
    # still accept the marker under --strict-markers (the tests bound their own processes as well).
    config.addinivalue_line(
        "markers", "timeout(seconds): fail the test after that many seconds (pytest-timeout)"
    )
