"""Fixtures of the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio as aioredis

from shared.coord import Coordinator, CoordSettings

CoordFactory = Callable[..., Coordinator]


@pytest.fixture
async def make_coord(redis_url: str, redis_prefix: str) -> AsyncIterator[CoordFactory]:
    """Coordinators over one client and this test's own key prefix (cleaned up by conftest)."""
    client = aioredis.from_url(redis_url)
    yield lambda **settings: Coordinator(client, redis_prefix, CoordSettings(**settings), run="test")
    await client.aclose()
