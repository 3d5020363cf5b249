"""python -m services.registry: serve the registry with RegistrySettings from SPARSECAST_* env."""

from __future__ import annotations

import logging
import sys

import uvicorn

from services.registry.settings import RegistrySettings
from shared.gcheap import freeze_startup_heap
from shared.http import require_token_off_loopback
from shared.settings_help import handle_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = handle_cli(argv, "python -m services.registry", __doc__ or "", RegistrySettings)
    if code is not None:
        return code
    from services.registry.app import create_app  # after --help: the app imports torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = RegistrySettings()
    require_token_off_loopback("registry", settings.host, settings.api_token)
    app = create_app(settings)
    freeze_startup_heap()  # a full GC pass would stall every download in flight (shared.gcheap)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info",
                timeout_keep_alive=settings.keep_alive_s)  # idle connections of slow clients close
    return 0


if __name__ == "__main__":
    sys.exit(main())
