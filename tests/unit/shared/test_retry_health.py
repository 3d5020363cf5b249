"""shared.retry (riding out outages) and shared.health (loop liveness), without services."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from redis import exceptions as redis_errors

from shared.errors import ServiceHTTPError
from shared.health import Liveness
from shared.registry.errors import RegistryHTTPError
from shared.retry import Outage, transient


@pytest.mark.parametrize(("exc", "expected"), [
    (redis_errors.ConnectionError("closed"), True),
    (redis_errors.BusyLoadingError("LOADING Redis is loading the dataset in memory"), True),
    (redis_errors.ResponseError("LOADING Redis is loading the dataset in memory"), True),
    (redis_errors.TimeoutError("timed out"), True),
    (httpx.ConnectError("refused"), True),
    (RegistryHTTPError(503, "store down"), True),
    (RegistryHTTPError(0, "upload interrupted"), True),
    (ConnectionResetError(), True),
    (RegistryHTTPError(409, "not the next version"), False),
    (ServiceHTTPError("trainer", 502, "bad gateway"), True),  # any service's client, not only the registry's
    (ServiceHTTPError("trainer", 404, "no such run"), False),
    (redis_errors.ResponseError("NOGROUP No such key"), False),
    (ValueError("a bug"), False),
    (FileNotFoundError("no such file"), False),
])
def test_transient_errors_are_the_ones_worth_waiting_out(exc: Exception, expected: bool) -> None:
    assert transient(exc) is expected


async def test_outage_logs_once_counts_and_backs_off_with_a_cap(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    log = logging.getLogger("test.outage")
    outage = Outage("redis", log, base_s=0.01, cap_s=0.04)
    failures = 0

    async def flaky() -> str:
        nonlocal failures
        if failures < 6:
            failures += 1
            raise redis_errors.ConnectionError("connection refused")
        return "ok"

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    beats: list[int] = []
    assert await outage.call(flaky, beat=lambda: beats.append(1)) == "ok"
    elapsed = loop.time() - t0
    # waits of 0.01, 0.02, 0.04, 0.04, 0.04, 0.04 s at most, each at least half of that
    assert 0.5 * 0.19 <= elapsed < 1.0
    assert (outage.outages, outage.failures, outage.down) == (1, 6, False)
    assert len(beats) == 7  # a loop waiting out the outage stays alive
    messages = [r.getMessage() for r in caplog.records if r.name == "test.outage"]
    assert messages[0].startswith("redis unavailable (ConnectionError: connection refused)")
    assert messages[1].startswith("redis available again after") and len(messages) == 2

    failures = 4  # a second outage is a second line and a second count
    await outage.call(flaky)
    assert outage.outages == 2 and len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


async def test_outage_gives_up_on_stop_and_on_other_errors() -> None:
    outage = Outage("registry", logging.getLogger("test.outage"), base_s=10, cap_s=10)
    stop = asyncio.Event()

    async def down() -> None:
        raise httpx.ConnectError("refused")

    task = asyncio.create_task(outage.call(down, stop))
    await asyncio.sleep(0.05)
    stop.set()  # the 10 s backoff ends at once, and the error comes out
    with pytest.raises(httpx.ConnectError):
        await asyncio.wait_for(task, 2)

    async def broken() -> None:
        raise ValueError("a bug is not an outage")

    with pytest.raises(ValueError):
        await outage.call(broken)


async def test_liveness_sees_dead_stuck_and_finished_loops() -> None:
    liveness = Liveness()

    async def forever() -> None:
        await asyncio.sleep(3600)

    async def crash() -> None:
        raise RuntimeError("boom")

    async def done() -> None:
        return None

    alive, dead, finished, ended = (asyncio.create_task(c()) for c in (forever, crash, done, done))
    liveness.watch("alive", alive, stall_s=60)
    liveness.watch("dead", dead, stall_s=60)
    liveness.watch("finished", finished, stall_s=60, may_finish=True)
    liveness.watch("ended", ended, stall_s=60)
    await asyncio.sleep(0.01)
    assert sorted(liveness.problems()) == ["dead loop died: RuntimeError: boom", "ended loop ended"]

    stuck = Liveness()
    moved = [0]
    stuck.watch("quiet", alive, stall_s=0.05)
    stuck.watch("downloading", alive, stall_s=0.05, progress=lambda: moved[0])
    await asyncio.sleep(0.03)
    stuck.problems()
    await asyncio.sleep(0.04)
    moved[0] += 1  # bytes still arriving: not stuck
    assert [p.split(":")[0] for p in stuck.problems()] == ["quiet loop stuck"]
    stuck.beat("quiet")
    assert stuck.problems() == []
    alive.cancel()
    await asyncio.sleep(0)
    assert "alive loop was cancelled" in liveness.problems()
