"""python -m services.registry: serve the registry with RegistrySettings from SPARSECAST_* env."""

from __future__ import annotations

import logging

import uvicorn

from services.registry.app import create_app
from services.registry.settings import RegistrySettings
from shared.http import require_token_off_loopback


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = RegistrySettings()
    require_token_off_loopback("registry", settings.host, settings.api_token)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


if __name__ == "__main__":
    main()
