"""python -m services.trainer — the trainer service (settings: SPARSECAST_* env vars, see README)."""

from __future__ import annotations

import logging

import uvicorn

from services.trainer.app import create_app
from services.trainer.settings import TrainerSettings
from shared.http import require_token_off_loopback


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    settings = TrainerSettings()
    require_token_off_loopback("trainer", settings.host, settings.api_token)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=60)


if __name__ == "__main__":
    main()
