"""The settings every service shares, read from SPARSECAST_* environment variables.

Each service's settings class derives from `ServiceSettings` (registry) or `ModelServiceSettings`
(trainer, rollout: they hold a model) and gives its own defaults. "Unset" is None for every
optional field; an empty environment value (SPARSECAST_API_TOKEN=) also means unset.
"""

from __future__ import annotations

from typing import Any, get_args

from pydantic import ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPARSECAST_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"  # loopback unless told otherwise; off loopback an API token is required
    port: int
    run: str = "default"
    # Bearer token of the service's writes; each service says what "unset" does.
    api_token: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "sparsecast"

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: Any, info: ValidationInfo) -> Any:
        # Only where None is allowed: an empty required value stays an error of its own.
        name = info.field_name
        if value == "" and name is not None and type(None) in get_args(cls.model_fields[name].annotation):
            return None
        return value


class ModelServiceSettings(ServiceSettings):
    """A service that holds a model: where the registry is, which device, where its files go."""

    registry_url: str | None = None
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    data_dir: str

    def resolved_device(self) -> str:
        """`device`, with auto resolved to cuda when a CUDA device is visible, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
