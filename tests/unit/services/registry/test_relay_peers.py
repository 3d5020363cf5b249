"""The registry's peer directory (relay fan-out): who is listed for an object, and for how long."""

from __future__ import annotations

from services.registry.peers import PeerDirectory

KEY = "patches/3-4.patch"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_first_asker_gets_no_peer_and_nobody_gets_itself() -> None:
    peers = PeerDirectory(max_listed=3)
    assert peers.announce("r", "a", "http://a", [KEY]) == {KEY: []}
    assert peers.announce("r", "b", "http://b", [KEY]) == {KEY: ["http://a"]}
    # Announcing again (a refresh) never lists the worker itself.
    assert "http://b" not in peers.announce("r", "b", "http://b", [KEY])[KEY]
    assert peers.holders("r", KEY, exclude="a") == ["http://b"]


def test_serving_is_spread_over_peers_least_listed_first() -> None:
    peers = PeerDirectory(max_listed=1)
    listed = [peers.announce("r", w, f"http://{w}", [KEY])[KEY] for w in "abcdefgh"]
    assert listed[0] == []
    served = [urls[0] for urls in listed[1:]]
    # With one peer listed per asker, no peer is handed out more than twice to 7 askers.
    assert max(served.count(u) for u in set(served)) <= 2
    assert len(set(served)) >= 4


def test_only_holders_of_the_object_are_listed() -> None:
    """A peer behind on versions holds older objects only: it is not listed for the new one."""
    peers = PeerDirectory()
    peers.announce("r", "old", "http://old", ["patches/2-3.patch"])
    assert peers.announce("r", "new", "http://new", [KEY]) == {KEY: []}
    assert peers.holders("r", "patches/2-3.patch") == ["http://old"]
    assert peers.holders("other-run", KEY) == []


def test_announcements_expire_and_leave_removes() -> None:
    clock = Clock()
    peers = PeerDirectory(ttl_s=10, clock=clock)
    peers.announce("r", "a", "http://a", [KEY])
    clock.now = 5
    peers.announce("r", "b", "http://b", [KEY])
    clock.now = 12  # a went silent more than ttl_s ago (dead); b announced 7 s ago
    assert peers.holders("r", KEY) == ["http://b"]
    assert peers.leave("r", "b") and not peers.leave("r", "b")
    assert peers.holders("r", KEY) == []


def test_rollout_relay_settings_and_route() -> None:
    """A rollout worker with relay on needs the addresses peers and the registry use, and serves
    the peer endpoint (nothing held yet: 404)."""
    import pytest
    from fastapi.testclient import TestClient
    from pydantic import ValidationError

    from services.rollout.app import create_app
    from services.rollout.settings import RolloutSettings, SyncSettings

    with pytest.raises(ValidationError, match="relay needs"):
        RolloutSettings(sync=SyncSettings(relay=True), registry_url="http://r:8100")
    settings = RolloutSettings(sync=SyncSettings(relay=True), registry_url="http://r:8100", advertise_url="http://w:8200",
                               registry_token="t")
    http = TestClient(create_app(settings))  # no lifespan: no model, only the routes
    answer = http.get("/v1/relay/run1/pieces", params={"key": "patches/0-1.patch", "first": 0})
    assert answer.status_code == 404 and "not held" in answer.json()["detail"]
    assert http.get("/v1/relay/run1/pieces", params={"key": "k", "first": "x"}).status_code == 422
    plain = TestClient(create_app(RolloutSettings()))
    missing = plain.get("/v1/relay/run1/pieces", params={"key": "k", "first": 0})
    assert missing.status_code == 404 and "not held" not in missing.text  # no relay route at all


def test_workers_asking_together_form_a_pipeline() -> None:
    """Each asker fetches from the newest holder nobody fetches from yet (a pipeline from the
    registry's one copy: every holder serves one peer), the others listed as fallbacks."""
    peers = PeerDirectory(max_listed=3)
    answers = [peers.announce("r", w, f"http://{w}", [KEY])[KEY] for w in "abcdefgh"]
    assert answers[0] == []
    assert [urls[0] for urls in answers[1:]] == [f"http://{w}" for w in "abcdefg"]
    assert answers[3] == ["http://c", "http://b", "http://a"]
    # A holder that died is skipped by the client; the next asker still gets a fresh holder.
    assert peers.announce("r", "i", "http://i", [KEY])[KEY][0] == "http://h"


def _v(a: int) -> str:
    return f"patches/{a}-{a + 1}.patch"


async def _join(peers: PeerDirectory, workers: str) -> None:
    """Workers join in this order, each at version 1."""
    for w in workers:
        await peers.announce_ordered("r", w, f"http://{w}", [_v(0)], wait_s=0)


def test_the_pipeline_keeps_its_order_from_version_to_version() -> None:
    """Whatever order workers learn of a version in, each fetches from its predecessor in the
    order they joined (the same neighbours every version: warm connections), the first from the
    registry."""
    import asyncio

    async def main() -> list[dict[str, list[str]]]:
        peers = PeerDirectory(max_listed=2)
        await _join(peers, "abcdefgh")
        rounds = []
        for version, arrival in ((1, "hcafbgde"), (2, "dhgfecba"), (3, "abcdefgh")):
            async def ask(w: str, delay: float, held: str, key: str) -> tuple[str, list[str]]:
                await asyncio.sleep(delay)
                answer = await peers.announce_ordered("r", w, f"http://{w}", [held, key], wait_s=2.0)
                return w, answer[key]

            answers = await asyncio.gather(*(ask(w, 0.005 * i, _v(version - 1), _v(version))
                                             for i, w in enumerate(arrival)))
            rounds.append(dict(answers))
        return rounds

    for answers in asyncio.run(main()):
        assert answers["a"] == []
        for before, w in zip("abcdefg", "bcdefgh", strict=True):
            assert answers[w][0] == f"http://{before}"


def test_a_predecessor_that_does_not_come_is_waited_for_once() -> None:
    import asyncio
    import time as wall

    async def main() -> None:
        peers = PeerDirectory()
        await _join(peers, "abc")
        start = wall.monotonic()
        # a is at version 1 but never announces patch 1-2 (busy, dying): b waits, then heads.
        assert (await peers.announce_ordered("r", "b", "http://b", [_v(1)], wait_s=0.2))[_v(1)] == []
        assert wall.monotonic() - start >= 0.2
        start = wall.monotonic()
        assert (await peers.announce_ordered("r", "c", "http://c", [_v(1)], wait_s=0.2))[_v(1)][0] == "http://b"
        assert wall.monotonic() - start < 0.1  # a is not waited for again on this object

    asyncio.run(main())


def test_only_predecessors_at_the_patch_base_are_waited_for() -> None:
    """A predecessor behind on versions (it will fetch a merged patch), an object the asker
    already held, and merged patches never make an announcement wait."""
    import asyncio
    import time as wall

    async def main() -> None:
        peers = PeerDirectory()
        await _join(peers, "ab")  # both at version 1
        start = wall.monotonic()
        assert (await peers.announce_ordered("r", "b", "http://b", [_v(2)], wait_s=1.0))[_v(2)] == []
        assert (await peers.announce_ordered("r", "b", "http://b", [_v(0)], wait_s=1.0))[_v(0)] == ["http://a"]
        assert (await peers.announce_ordered("r", "b", "http://b", ["merged/1-3.patch"], wait_s=1.0)) == {
            "merged/1-3.patch": []}
        assert wall.monotonic() - start < 0.1

    asyncio.run(main())


def test_a_worker_that_expires_rejoins_at_the_end() -> None:
    clock = Clock()
    peers = PeerDirectory(ttl_s=10, clock=clock)
    for w in "abc":
        peers.announce("r", w, f"http://{w}", [KEY])
    clock.now = 5
    for w in "bc":
        peers.announce("r", w, f"http://{w}", [KEY])
    clock.now = 12  # a expired
    assert peers.announce("r", "a", "http://a", [KEY])[KEY] == ["http://c", "http://b"]
    assert peers.announce("r", "b", "http://b", [KEY])[KEY] == []  # now first in the order
    assert peers.announce("r", "c", "http://c", [KEY])[KEY] == ["http://b"]
