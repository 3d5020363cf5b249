"""python -m services.rollout — a rollout worker (settings: SPARSECAST_* env vars, docs/configuration.md)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from services.rollout.settings import RolloutSettings
from shared.gcheap import freeze_startup_heap
from shared.http import require_token_off_loopback
from shared.registry.transport import KEEP_ALIVE_S
from shared.relay import peer_listener
from shared.settings_help import handle_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = handle_cli(argv, "python -m services.rollout", __doc__ or "", RolloutSettings)
    if code is not None:
        return code
    from services.rollout.app import create_app  # after --help: the app imports torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(name)s: %(message)s")
    settings = RolloutSettings()
    require_token_off_loopback("rollout", settings.host, settings.api_token)
    # Its relay endpoint (shared.relay) serves peers over kept-alive connections, on sockets with
    # buffers wider than autotuning's where the kernel allows (a window for 1 Gbit/s at 100 ms) and
    # the peers' congestion control.
    config = uvicorn.Config(create_app(settings), log_level="info", timeout_graceful_shutdown=30,
                            timeout_keep_alive=KEEP_ALIVE_S)
    freeze_startup_heap()  # a full GC pass would stall the streams this worker relays (shared.gcheap)
    uvicorn.Server(config).run(sockets=[peer_listener(settings.host, settings.port,
                                                          congestion=settings.sync.peer_congestion)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
