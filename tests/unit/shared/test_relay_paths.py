"""What a worker measures of its sources and reports (shared.relay: PathSample, Relay.paths): the
announcement's bounds, the smoothing, and the peer's reported wait."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from shared.registry.download import HalfWay, PathTiming
from shared.relay import (
    MAX_PATHS,
    MIN_RATE_BYTES,
    REGISTRY_SOURCE,
    PeerAnnouncement,
    Relay,
    _server_wait_s,
)

URL = "http://10.0.0.2:8300"
SAMPLE = {"rtt_s": 0.1, "rate_bps": 1e9}


def test_an_announcement_without_paths_is_an_older_workers_and_valid() -> None:
    assert PeerAnnouncement.model_validate({"url": URL, "objects": []}).paths == {}
    paths = {REGISTRY_SOURCE: SAMPLE, URL: SAMPLE}
    body = PeerAnnouncement.model_validate({"url": URL, "objects": [], "paths": paths})
    assert body.paths[URL].rate_bps == 1e9


@pytest.mark.parametrize("paths", [
    {REGISTRY_SOURCE: {**SAMPLE, "rtt_s": -0.1}},
    {REGISTRY_SOURCE: {**SAMPLE, "rate_bps": -1}},
    {REGISTRY_SOURCE: {**SAMPLE, "rtt_s": math.nan}},
    {REGISTRY_SOURCE: {**SAMPLE, "rate_bps": math.inf}},
    {REGISTRY_SOURCE: {**SAMPLE, "rtt_s": 1e6}},
    {REGISTRY_SOURCE: {"rtt_s": 0.1}},
    {"peer-a": SAMPLE},  # a source is a URL or the registry
    {f"http://10.0.0.{i}:8300": SAMPLE for i in range(MAX_PATHS + 1)},
])
def test_bad_paths_are_refused(paths: dict) -> None:
    with pytest.raises(ValidationError):
        PeerAnnouncement.model_validate({"url": URL, "objects": [], "paths": paths})


def timing(rtt_s: float, nbytes: int, seconds: float) -> PathTiming:
    """A stream of `nbytes` whose second half took `seconds` (its rate: nbytes / 2 / seconds)."""
    measured = PathTiming()
    measured.answered(rtt_s)
    measured.received(nbytes, nbytes // 2, 10.0, 10.0 + seconds)
    return measured


def test_each_source_is_smoothed_and_the_latest_kept() -> None:
    relay = Relay("w", "http://w:8300")
    relay._note(URL, timing(0.1, MIN_RATE_BYTES - 1, 1.0))  # too few bytes for a rate
    assert relay.paths == {}
    relay._note(URL, timing(0.1, 1 << 20, 0.01))  # its second half, 512 KiB, in 10 ms
    first = relay.paths[URL]
    assert first.rtt_s == pytest.approx(0.1) and first.rate_bps == pytest.approx((1 << 19) * 8 / 0.01)
    relay._note(URL, timing(0.3, 1 << 20, 0.02))
    assert relay.paths[URL].rtt_s == pytest.approx(0.2)  # half the new, half the old
    assert relay.paths[URL].rate_bps == pytest.approx(0.75 * first.rate_bps)
    for i in range(MAX_PATHS):
        relay._note(f"http://10.0.1.{i}:8300", timing(0.1, 1 << 20, 0.01))
    assert len(relay.paths) == MAX_PATHS and URL not in relay.paths  # the oldest measured goes


def test_several_streams_at_once_count_together() -> None:
    """The registry's pieces come over several streams at once: their second halves' bytes over
    their span, and the shortest round trip."""
    measured = PathTiming()
    for half_at, rtt in ((0.0, 0.2), (0.1, 0.1)):
        measured.answered(rtt)
        measured.received(1000, 500, half_at, half_at + 1.0)
    assert measured.rtt_s == 0.1 and measured.rate_bps() == pytest.approx(1000 * 8 / 1.1)
    assert measured.bytes == 2000
    assert PathTiming().rate_bps() is None
    measured.received(1000, 0, None, 5.0)  # a stream that stopped before its middle: bytes only
    assert measured.bytes == 3000 and measured.rate_bps() == pytest.approx(1000 * 8 / 1.1)


def test_a_relayed_stream_is_rated_by_its_second_half() -> None:
    """A stream that drains its source's backlog at 1 Gbit/s and then flows at the 100 Mbit/s its
    source receives is measured at 100 Mbit/s, not the average of both."""
    half = HalfWay(0, 2_000_000)
    clock = iter([0.008, 0.16])  # the middle byte 8 ms in (the backlog), the last 160 ms in
    half.passed(999_999, lambda: 0.0)
    half.passed(1_000_000, lambda: next(clock))
    half.passed(1_500_000, lambda: next(clock))  # past the middle: the clock is read once
    measured = PathTiming()
    measured.received(2_000_000, half.tail(2_000_000), half.at, 0.088)
    assert half.at == 0.008 and measured.rate_bps() == pytest.approx(1e8)


def test_the_peers_wait_is_read_from_server_timing() -> None:
    assert _server_wait_s("wait;dur=12.5") == pytest.approx(0.0125)
    assert _server_wait_s("db;dur=3, wait;dur=7") == pytest.approx(0.007)
    assert _server_wait_s("") == 0.0 and _server_wait_s("await;dur=5") == 0.0
