"""Integration tests start real local services (olah, ...); select or skip them with -m integration."""
from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: starts real local services; slower than unit tests")
