"""`python -m services.<name> --help`: a service's settings as the environment variables that set them.

The services take no command-line arguments; everything is a SPARSECAST_* variable read by a
pydantic-settings class. This prints that class as a table (name, type, default, description) and
tells the caller whether to exit instead of starting.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from pydantic import BaseModel
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

SECRET_WORDS = ("token", "secret", "password", "key_id")


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    return text or str(annotation).replace("typing.", "").replace("NoneType", "None")


def settings_rows(settings_cls: type[BaseSettings]) -> Iterator[tuple[str, str, str, str]]:
    """(variable, type, default, description) for every setting, nested models expanded with the
    class's nested delimiter (e.g. SPARSECAST_LOSS__AGGREGATION)."""
    config = settings_cls.model_config
    prefix, delimiter = config.get("env_prefix", ""), config.get("env_nested_delimiter") or None

    def walk(model: type[BaseModel], path: str) -> Iterator[tuple[str, str, str, str]]:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
            if nested and delimiter:
                yield from walk(cast(type[BaseModel], annotation), f"{path}{name}{delimiter}")
                continue
            if field.default_factory is not None:
                # Settings never take validated-data factories: a plain factory is called bare.
                factory = cast(Callable[[], Any], field.default_factory)
                default = "(computed)" if nested else repr(factory())
            elif field.default is PydanticUndefined:
                default = "(required)"
            elif any(word in name for word in SECRET_WORDS):
                default = "(set)" if field.default else "(unset)"
            else:
                default = repr(field.default)
            yield (f"{prefix}{path}{name}".upper(), _type_name(annotation), default, field.description or "")

    yield from walk(settings_cls, "")


def settings_help(prog: str, summary: str, settings_cls: type[BaseSettings]) -> str:
    rows = list(settings_rows(settings_cls))
    width = max(len(r[0]) for r in rows)
    lines = [
        f"usage: {prog}",
        "",
        summary.strip(),
        "",
        "Takes no arguments: every setting is an environment variable (defaults below).",
        "",
    ]
    for variable, kind, default, description in rows:
        line = f"  {variable:<{width}}  {kind} = {default}"
        lines.append(line + (f"  ({description})" if description else ""))
    return "\n".join(lines) + "\n"


def handle_cli(argv: Sequence[str], prog: str, summary: str, settings_cls: type[BaseSettings]) -> int | None:
    """None: start the service. Else the exit status: 0 after --help, 2 for any other argument."""
    if not argv:
        return None
    if argv[0] in ("-h", "--help"):
        sys.stdout.write(settings_help(prog, summary, settings_cls))
        return 0
    sys.stderr.write(
        f"{prog}: takes no arguments (got {' '.join(argv)}); settings are SPARSECAST_* "
        f"environment variables, see {prog} --help\n"
    )
    return 2
