"""python -m services.trainer — the trainer service (settings: SPARSECAST_* env vars, see README)."""

from __future__ import annotations

import logging
import sys

import uvicorn

from services.trainer.settings import TrainerSettings
from shared.http import require_token_off_loopback
from shared.settings_help import handle_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = handle_cli(argv, "python -m services.trainer", __doc__ or "", TrainerSettings)
    if code is not None:
        return code
    from services.trainer.app import create_app  # after --help: the app imports torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    settings = TrainerSettings()
    require_token_off_loopback("trainer", settings.host, settings.api_token)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
