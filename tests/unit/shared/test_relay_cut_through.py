"""Cut-through relaying (shared.relay.Holdings.stream): a holder sends a piece's bytes on as they
land in its buffer, before the piece is whole or verified, in order, and stops when no byte more
comes within its wait."""

from __future__ import annotations

import asyncio
import hashlib
import mmap

from shared.registry.download import _Download
from shared.registry.wire import ObjectRef
from shared.relay import Holdings

PIECE = 1024


def _download(data: bytes) -> _Download:
    pieces = [hashlib.sha256(data[i : i + PIECE]).hexdigest() for i in range(0, len(data), PIECE)]
    ref = ObjectRef(key="patches/0-1.patch", size=len(data), piece_bytes=PIECE, pieces=pieces)
    return _Download(ref, mmap.mmap(-1, len(data)), [False] * len(pieces))


def _land(download: _Download, data: bytes, start: int, end: int) -> None:
    download.buffer[start:end] = data[start:end]
    download.landed(start, end)


async def _next(stream, timeout_s: float = 1.0) -> bytes:  # type: ignore[no-untyped-def]
    return bytes(await asyncio.wait_for(anext(stream), timeout_s))


def test_bytes_go_on_before_their_piece_is_whole_or_verified() -> None:
    data = bytes(range(256)) * 12  # three pieces, the last one short
    download = _download(data)

    async def scenario() -> None:
        holdings = Holdings()
        stream = holdings.stream(download, 0, 3, wait_s=1.0)
        _land(download, data, 0, 300)  # a third of piece 0: nothing of it is verified
        assert await _next(stream) == data[0:300]
        pending = asyncio.ensure_future(_next(stream))
        await asyncio.sleep(0.05)
        assert not pending.done()  # waits for more bytes: woken by the write, not polling
        _land(download, data, 300, PIECE + 100)  # the rest of piece 0 and the start of piece 1
        assert await pending == data[300:PIECE]  # in order: piece 0 first
        assert await _next(stream) == data[PIECE : PIECE + 100]
        download.mark_done(0)
        download.buffer[PIECE : 2 * PIECE] = data[PIECE : 2 * PIECE]  # from a part file, say
        download.mark_done(1)  # verified: all of it can go
        assert await _next(stream) == data[PIECE + 100 : 2 * PIECE]
        _land(download, data, 2 * PIECE, len(data))
        assert await _next(stream) == data[2 * PIECE :]
        assert holdings.served_bytes == len(data) and holdings.served_pieces == 3

    asyncio.run(scenario())


def test_the_stream_ends_when_no_byte_more_comes() -> None:
    data = bytes(3 * PIECE)
    download = _download(data)

    async def scenario() -> None:
        stream = Holdings().stream(download, 0, 3, wait_s=0.1)
        _land(download, data, 0, 10)
        assert await _next(stream) == data[:10]
        ended = False
        try:
            await _next(stream)
        except StopAsyncIteration:
            ended = True
        assert ended  # the asker then takes the rest from another peer or the registry

    asyncio.run(scenario())


def test_available_is_what_landed_until_verified() -> None:
    download = _download(bytes(2 * PIECE))
    download.landed(0, PIECE + 10)
    assert [download.available(0), download.available(1)] == [PIECE, 10]
    download.landed(0, 5)  # a fallback rewriting piece 0 from its start: nothing is taken back
    assert download.available(0) == PIECE
    download.mark_done(1)
    assert download.available(1) == PIECE
