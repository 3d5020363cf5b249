"""The settings every service shares, read from SPARSECAST_* environment variables.

Each service's settings class derives from `ServiceSettings` (registry) or `ModelServiceSettings`
(trainer, rollout: they hold a model) and gives its own defaults. "Unset" is None for every
optional field; an empty environment value (SPARSECAST_API_TOKEN=) also means unset. A setting
moved into a nested section keeps its old flat name for a while (`FlatAliases`, warned once).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, ClassVar, get_args

from pydantic import ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.schemas import DEFAULT_RUN

log = logging.getLogger(__name__)
_warned_fallback: set[str] = set()  # services already told that their publish token falls back
_warned_aliases: set[str] = set()  # deprecated flat variables already warned about


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPARSECAST_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"  # loopback unless told otherwise; off loopback an API token is required
    port: int
    run: str = DEFAULT_RUN
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

    # Deprecated flat names of this service's nested sections (`FlatAliases`): flat name without the
    # prefix → (section, field).
    flat_aliases: ClassVar[Mapping[str, tuple[str, str]]] = {}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The flat names rank just below the environment's own (nested) names.
        flat = (FlatAliases(settings_cls, cls.flat_aliases),) if cls.flat_aliases else ()
        return (init_settings, env_settings, *flat, dotenv_settings, file_secret_settings)

    @model_validator(mode="before")
    @classmethod
    def _no_flat_arguments(cls, data: Any) -> Any:
        # Ignored silently otherwise (extra="ignore"): a flat keyword is an error, not a no-op.
        if isinstance(data, dict) and (flat := sorted(set(data) & set(cls.flat_aliases))):
            section = cls.flat_aliases[flat[0]][0]
            flat = [n for n in flat if cls.flat_aliases[n][0] == section]  # one section per message
            kind = getattr(cls.model_fields[section].annotation, "__name__", section)
            fields = ", ".join(f"{cls.flat_aliases[n][1]}=..." for n in flat)
            raise ValueError(f"{', '.join(flat)}: the {section} settings are one section now, "
                             f"{section}={kind}({fields})")
        return data


class FlatAliases(PydanticBaseSettingsSource):
    """Deprecated flat environment names of nested settings, e.g. SPARSECAST_KV_BUDGET for
    SPARSECAST_KV__BUDGET: `aliases` maps the flat name without the prefix (`kv_budget`) to its
    (section, field). Read below the environment's own names (the nested name wins when both are
    set); each one set is warned about once per process."""

    def __init__(self, settings_cls: type[BaseSettings], aliases: Mapping[str, tuple[str, str]]) -> None:
        super().__init__(settings_cls)
        self.aliases = aliases

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads the aliases, not the fields

    def __call__(self) -> dict[str, Any]:
        prefix = self.config.get("env_prefix", "")
        delimiter = self.config.get("env_nested_delimiter") or "__"
        case_sensitive = self.config.get("case_sensitive", False)
        env = dict(os.environ) if case_sensitive else {k.lower(): v for k, v in os.environ.items()}
        values: dict[str, dict[str, str]] = {}
        for flat, (section, field) in self.aliases.items():
            name = f"{prefix}{flat}"
            value = env.get(name if case_sensitive else name.lower())
            if value is None:
                continue
            values.setdefault(section, {})[field] = value
            if name.upper() not in _warned_aliases:
                _warned_aliases.add(name.upper())
                log.warning("%s is deprecated: set %s instead (the flat name will be removed)",
                            name.upper(), f"{prefix}{section}{delimiter}{field}".upper())
        return values


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


def publish_credential(publish_token: str | None, api_token: str | None, service: str) -> str | None:
    """The bearer token of registry writes (patches, snapshots, model files): `publish_token`
    (SPARSECAST_PUBLISH_TOKEN). Unset, the API token, as before the two were separate; that is
    deprecated (whoever may submit prompts could then publish weights) and warned once per service."""
    if publish_token:
        return publish_token
    if api_token and service not in _warned_fallback:
        _warned_fallback.add(service)
        log.warning("%s: SPARSECAST_PUBLISH_TOKEN is unset, so registry writes use SPARSECAST_API_TOKEN; "
                    "this fallback is deprecated: set a publish token of its own (docs/deploy.md)", service)
    return api_token
