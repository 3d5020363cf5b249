"""The client's token bucket: the long-run rate is exact and the burst stays small (fake clock)."""

from __future__ import annotations

import asyncio

import pytest

from shared.registry.download import TokenBucket


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


async def test_rate_is_exact_from_the_first_byte() -> None:
    t = FakeTime()
    bucket = TokenBucket(8_000_000, burst_bytes=10_000, clock=t.clock, sleep=t.sleep)  # 1 MB/s
    for _ in range(100):
        await bucket.take(10_000)
    # 1 MB through a 1 MB/s bucket that starts empty: 1 s of waiting, no more, no less.
    assert t.now == pytest.approx(1.0)


async def test_idle_time_refills_only_up_to_the_burst() -> None:
    t = FakeTime()
    bucket = TokenBucket(8_000, burst_bytes=100, clock=t.clock, sleep=t.sleep)  # 1 kB/s
    t.now += 3600.0  # a long idle period must not bank an hour of tokens
    await bucket.take(1_100)
    assert t.slept == [pytest.approx(1.0)]


async def test_streams_share_one_rate() -> None:
    t = FakeTime()
    bucket = TokenBucket(8_000_000, burst_bytes=0, clock=t.clock, sleep=t.sleep)

    async def stream() -> None:
        for _ in range(10):
            await bucket.take(25_000)

    await asyncio.gather(*(stream() for _ in range(4)))
    assert t.now == pytest.approx(1.0)  # 4 × 250 kB at 1 MB/s, whatever the interleaving


def test_default_burst_is_about_ten_milliseconds() -> None:
    assert TokenBucket(1e9).capacity == int(1e9 / 8 / 100)
    assert TokenBucket(1e6).capacity == 16 << 10  # floor: one read of a stream
    with pytest.raises(ValueError):
        TokenBucket(0)
