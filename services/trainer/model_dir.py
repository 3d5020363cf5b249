"""Where the trainer's model weights come from: the tiny-demo warm start, or a HF model folder.

Its own module so that both the service (core.py) and the distributed start-up (distributed.py,
which core.py imports) can resolve the folder without importing each other.
"""

from __future__ import annotations

from pathlib import Path

from services.trainer.settings import TrainerSettings


def resolve_model_dir(settings: TrainerSettings) -> Path:
    if settings.model == "tiny-demo":
        from services.trainer.warmstart import ensure_warmstart_model

        return ensure_warmstart_model(Path(settings.warmstart_cache))
    path = Path(settings.model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a HF model directory (no config.json); use 'tiny-demo' or a model dir")
    return path
