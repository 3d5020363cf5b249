"""The `sampling` settings section: how rollouts are drawn, one default for trainer and workers.

The workers sample at these values; the trainer recomputes logp_old_dense at the same temperature
over the full vocabulary and refuses trajectories sampled otherwise (shared.agreement). Both
services read the section from SPARSECAST_SAMPLING__TEMPERATURE and SPARSECAST_SAMPLING__TOP_P
(the flat SPARSECAST_TEMPERATURE / SPARSECAST_TOP_P still work, deprecated).

Pydantic only (no torch): settings, the CLI and the deploy generators read it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)


# The flat names of the section's fields before it was one (deprecated; shared.settings.FlatAliases).
FLAT_SAMPLING_NAMES: dict[str, tuple[str, str]] = {
    field: ("sampling", field) for field in ("temperature", "top_p")
}
