"""shared.gcheap: the start-up heap leaves the collector's full passes; later garbage does not."""

from __future__ import annotations

import gc
import socket
import weakref
from pathlib import Path

import pytest

from shared.gcheap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_frozen_objects_leave_full_passes_and_later_cycles_are_still_collected() -> None:
    long_lived = [_Node() for _ in range(20_000)]  # what imports leave: alive as long as the process
    try:
        frozen = freeze_startup_heap()
        assert frozen >= len(long_lived) and gc.get_freeze_count() == frozen
        # A full pass walks the young generations and generation 2, not the permanent one.
        walked = sum(len(gc.get_objects(generation)) for generation in range(3))
        assert walked < len(long_lived) < frozen
        later = _Node()
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None  # garbage made after the freeze is collected as before
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_service_entry_points_freeze_once_the_app_is_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`python -m services.registry` and `python -m services.rollout` freeze after building their
    app and before serving: the app handed to uvicorn is already out of the collector's reach."""
    import uvicorn

    import services.registry.__main__ as registry_main
    import services.rollout.__main__ as rollout_main
    from shared.ports import free_port

    served: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **_: served.append(app))

    def serve(self: uvicorn.Server, sockets: list[socket.socket]) -> None:
        served.append(self.config.app)
        for listener in sockets:  # the rollout's peer listener, bound for real: not left open
            listener.close()

    monkeypatch.setattr(uvicorn.Server, "run", serve)
    monkeypatch.setenv("SPARSECAST_STORE_URL", f"file://{tmp_path}/store")
    monkeypatch.setenv("SPARSECAST_PORT", str(free_port()))
    try:
        for main in (registry_main.main, rollout_main.main):
            gc.unfreeze()
            assert main([]) == 0
            app = served[-1]
            assert gc.get_freeze_count() > 0
            assert not any(app is o for generation in range(3) for o in gc.get_objects(generation))
    finally:
        gc.unfreeze()
