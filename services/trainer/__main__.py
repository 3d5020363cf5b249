"""python -m services.trainer — the trainer service (settings: SPARSECAST_* env vars, see README).

Under torchrun with more than one process (docs/distributed.md), rank 0 serves the API and drives
the learner; the other ranks build the same sharded learner and follow rank 0's commands."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist
import uvicorn

from services.trainer.app import create_app
from services.trainer.core import resolve_model_dir
from services.trainer.distributed import (
    DistributedLearner,
    control_group,
    follow_until_stopped,
    init_process_groups,
    launched_distributed,
)
from services.trainer.settings import TrainerSettings
from shared.http import require_token_off_loopback


def prepare_model(settings: TrainerSettings) -> Path:
    """The model directory, made by rank 0 first when it must be (the tiny-demo warm start), then
    by the others from its cache (on one node; several nodes need a model directory they all see)."""
    if dist.get_rank() == 0:
        path = resolve_model_dir(settings)
        dist.barrier(group=control_group())
    else:
        dist.barrier(group=control_group())
        path = resolve_model_dir(settings)
    return path


def run_follower(settings: TrainerSettings, model_dir: Path) -> None:
    """Ranks > 0: the same learner as rank 0's, driven by it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    follow_until_stopped(DistributedLearner(settings, model_dir, pad_id))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(name)s: %(message)s")
    settings = TrainerSettings()
    if launched_distributed():
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
