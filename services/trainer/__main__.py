"""python -m services.trainer — the trainer service (settings: SPARSECAST_* env vars,
docs/configuration.md).

Under torchrun with more than one process (docs/distributed.md), rank 0 serves the API and drives
the learner; the other ranks build the same sharded learner and follow rank 0's commands."""

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
    # After --help: the app and the distributed learner import torch.
    from services.trainer.app import create_app
    from services.trainer.distributed import (
        init_process_groups,
        launched_distributed,
        prepare_model,
        run_follower,
    )

    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    settings = TrainerSettings()
    if launched_distributed():
        rank, world = init_process_groups(settings.device)
        logging.getLogger(__name__).info("rank %d of %d", rank, world)
        model_dir = prepare_model(settings)  # rank 0 first (a warm start is trained once)
        if rank > 0:
            run_follower(settings, model_dir)
            return 0
    require_token_off_loopback("trainer", settings.host, settings.api_token)
    if not settings.worker_token:
        logging.getLogger(__name__).warning(
            "SPARSECAST_WORKER_TOKEN is unset: trajectories are not authenticated (only their groups and "
            "rewards are checked against the ledger); set it on the trainer and every worker off loopback")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
