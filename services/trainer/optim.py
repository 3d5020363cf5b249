"""The optimizer section of the trainer's settings (`TrainerSettings.optim`, SPARSECAST_OPTIM__LR,
__WEIGHT_DECAY, __BETA1, __BETA2, __GRAD_CLIP): AdamW's hyperparameters and the gradient clip,
each with its one default. `DEMO_OPTIM` is the demo's, a named value of the same section.

Pydantic only (no torch): the CLI and the demo read it without loading the learner.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class OptimSettings(BaseModel):
    """AdamW and the gradient clip. The defaults are Sparse-RL's (lr 1e-6, weight decay 0.1,
    betas (0.9, 0.98), clip 1.0 on 1.5B-7B models)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=1e-6, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW decoupled weight decay")
    beta1: float = Field(default=0.9, description="AdamW beta1")
    beta2: float = Field(default=0.98, description="AdamW beta2")
    grad_clip: float = Field(default=1.0, gt=0, description="max global gradient norm")


# The demo's (`make demo`, the deployments' CPU defaults): the tiny demo model needs a larger lr
# than Sparse-RL's 1e-6 to move within minutes.
DEMO_OPTIM = OptimSettings(lr=5e-5)
