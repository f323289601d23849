"""Fixtures for the bench tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.bench.fake_openai import FakeServer, running_fake_server


@pytest.fixture()
def fake_server() -> Iterator[FakeServer]:
    with running_fake_server() as server:
        yield server
