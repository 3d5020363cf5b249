"""python -m services.rollout — a rollout worker (settings: SPARSECAST_* env vars, see README)."""

from __future__ import annotations

import logging

import uvicorn

from services.rollout.app import create_app
from services.rollout.settings import RolloutSettings
from shared.http import require_token_off_loopback


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rollout %(levelname)s %(name)s: %(message)s")
    settings = RolloutSettings()
    require_token_off_loopback("rollout", settings.host, settings.api_token)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
