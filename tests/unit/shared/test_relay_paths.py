"""What a worker measures of its sources and reports (shared.relay: PathSample, Relay.paths): the
announcement's bounds, the smoothing, and the peer's reported wait."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from shared.registry.download import MAX_ARRIVALS, PathTiming
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
    measured.landed(nbytes // 2, 10.0)
    measured.landed(nbytes - nbytes // 2, 10.0 + seconds)
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
    """Two streams at once, each 1,000 bytes a second: 2,000 together, and the shortest round
    trip."""
    measured = PathTiming()
    for rtt in (0.2, 0.1):
        measured.answered(rtt)
    for tick in range(1, 11):  # the two streams' chunks interleaved, 100 bytes each per 0.1 s
        measured.landed(100, tick / 10)
        measured.landed(100, tick / 10 + 0.01)
    assert measured.rtt_s == 0.1 and measured.bytes == 2000
    assert measured.rate_bps() == pytest.approx(1000 * 8 / 0.5)  # 1,000 bytes after the middle in 0.5 s
    assert PathTiming().rate_bps() is None
    one = PathTiming()
    one.landed(1000, 5.0)  # all at once: no span to divide by
    assert one.bytes == 1000 and one.rate_bps() is None


def test_a_small_answer_whose_last_chunk_brings_most_still_has_a_rate() -> None:
    """A small answer in two chunks, the last one most of it (CI once read no rate for the
    registry's path here: the arrival that passed half the bytes was the last one). The span is
    from the chunk before; an answer in one chunk is rated from its headers (the registry's
    fetch notes a zero-byte arrival when they come)."""
    two = PathTiming()
    two.landed(100, 1.0)
    two.landed(900, 1.1)
    assert two.rate_bps() == pytest.approx(900 * 8 / 0.1)
    headers_then_body = PathTiming()
    headers_then_body.landed(0, 2.0)
    headers_then_body.landed(4096, 2.01)
    assert headers_then_body.rate_bps() == pytest.approx(4096 * 8 / 0.01)


def test_pieces_one_request_after_another_read_the_path_rate() -> None:
    """The registry sends a relay's head one piece per request, one after another, at 100 Mbit/s:
    the path reads 100 Mbit/s. (Rated per request, each request's second half over the span from
    the first to the last, it read about half of it, and the measured tree then let every worker
    serve two or three children where the chain was as fast.)"""
    measured = PathTiming()
    piece, rate = 4 << 20, 1e8
    at = 0.0
    for _ in range(16):
        at += 0.1  # the request's round trip: no bytes
        for _ in range(64):  # the piece in 64 chunks at the path's rate
            at += piece / 64 * 8 / rate
            measured.landed(piece // 64, at)
    # The last eight pieces, each with its turnaround (0.1 s against 0.34 s of transfer): 77 Mbit/s.
    assert measured.rate_bps() == pytest.approx(piece * 8 / (0.1 + piece * 8 / rate))


def test_a_relayed_stream_is_rated_by_its_second_half() -> None:
    """A stream that drains its source's backlog at 1 Gbit/s and then flows at the 100 Mbit/s its
    source receives is measured at 100 Mbit/s, not the average of both."""
    measured = PathTiming()
    for i in range(1, 11):  # the backlog: 1 MB in 8 ms
        measured.landed(100_000, 0.0008 * i)
    for i in range(1, 11):  # then 1 MB at 100 Mbit/s
        measured.landed(100_000, 0.008 + 0.008 * i)
    assert measured.rate_bps() == pytest.approx(1e8)


def test_a_long_fetch_keeps_few_arrivals_and_its_rate() -> None:
    """A fetch of many chunks keeps at most MAX_ARRIVALS of them, the last always, and still
    reads its second half's rate: 50 MB at 1 Gbit/s after 50 MB at 2."""
    measured = PathTiming()
    chunk, at = 10_000, 0.0
    for i in range(10_000):
        at += chunk * 8 / (2e9 if i < 5_000 else 1e9)
        measured.landed(chunk, at)
    assert len(measured.arrivals) <= MAX_ARRIVALS and measured.arrivals[-1] == (at, 10_000 * chunk)
    assert measured.rate_bps() == pytest.approx(1e9, rel=1e-3)


def test_the_peers_wait_is_read_from_server_timing() -> None:
    assert _server_wait_s("wait;dur=12.5") == pytest.approx(0.0125)
    assert _server_wait_s("db;dur=3, wait;dur=7") == pytest.approx(0.007)
    assert _server_wait_s("") == 0.0 and _server_wait_s("await;dur=5") == 0.0
