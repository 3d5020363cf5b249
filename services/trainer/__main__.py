"""python -m services.trainer — the trainer service (settings: SPARSECAST_* env vars, see README).

Under torchrun with more than one process (docs/distributed.md), rank 0 serves the API and drives
the learner; the other ranks build the same sharded learner and follow rank 0's commands."""

from __future__ import annotations

import logging

import uvicorn

from services.trainer.app import create_app
from services.trainer.settings import TrainerSettings
from shared.http import require_token_off_loopback


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    settings = TrainerSettings()
    from services.trainer.distributed import launched_distributed

    if launched_distributed():
        from services.trainer.distributed import init_process_groups, prepare_model, run_follower

        rank, world = init_process_groups(settings.device)
        logging.getLogger(__name__).info("rank %d of %d", rank, world)
        model_dir = prepare_model(settings)  # rank 0 first (a tiny-demo warm start is trained once)
        if rank > 0:
            run_follower(settings, model_dir)
            return
    require_token_off_loopback("trainer", settings.host, settings.api_token)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=60)


if __name__ == "__main__":
    main()
