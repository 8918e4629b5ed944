"""Command-line flags made from settings classes: one flag per field (`max_lora_rank` -> `--max-lora-rank`), its
help naming the default and the `LORAPLEX_*` variable, its value checked by the field's own type; and the settings
built back from the parsed flags (flag > environment variable > default).

`loraplex serve` uses ServeSettings, `loraplex generate` EngineSettings: the engine's flags of both come from
EngineConfig, so they have the same names, types and defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

from gateway.engine_settings import ENGINE_OPTIONS, ENV_PREFIX

ENGINE_GROUP = "engine options (EngineConfig; also LORAPLEX_* variables)"


def _scalar(annotation: Any) -> Any:
    """`X | None` -> X."""
    if get_origin(annotation) not in (Union, UnionType):
        return annotation
    args = [a for a in get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else annotation


def _converter(name: str, field: FieldInfo):
    """Text -> the field's value, through the field's own pydantic type (and validators, e.g. sizes like 2GiB)."""
    adapter = TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)

    def convert(text: str) -> Any:
        try:
            return adapter.validate_python(text)
        except ValidationError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e.errors()[0]['msg']}") from None

    convert.__name__ = name
    return convert


def _help(name: str, field: FieldInfo) -> str:
    default = "" if field.default in (None, PydanticUndefined) else f" (default: {field.default})"
    return f"{field.description}{default} [env {ENV_PREFIX}{name.upper()}]"


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings: type[BaseSettings],
    only: Iterable[str] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """One flag per field of `settings` (those in `only`, if given, less `skip`); the engine's in their own group.
    Flags have no argparse default, so an unset flag leaves the value to the environment, then the field's default."""
    engine = parser.add_argument_group(ENGINE_GROUP)
    chosen = set(settings.model_fields) if only is None else set(only)
    for name, field in settings.model_fields.items():
        if name not in chosen or name in skip:
            continue
        target = engine if name in ENGINE_OPTIONS else parser
        flag, kind = "--" + name.replace("_", "-"), _scalar(field.annotation)
        if get_origin(kind) is list:
            target.add_argument(flag, nargs="+", action="extend", default=argparse.SUPPRESS, help=_help(name, field))
        elif kind is bool:
            action = argparse.BooleanOptionalAction
            target.add_argument(flag, action=action, default=argparse.SUPPRESS, help=_help(name, field))
        else:
            choices = get_args(kind) if get_origin(kind) is Literal else None
            target.add_argument(
                flag, type=_converter(name, field), choices=choices, default=argparse.SUPPRESS, help=_help(name, field)
            )


def settings_from_args(
    settings: type[BaseSettings], args: argparse.Namespace, command: str, skip: Iterable[str] = ()
) -> Any:
    """`settings` from the flags given (the environment and defaults fill the rest); a bad value exits naming it."""
    given = {
        name: value
        for name, value in vars(args).items()
        if name in settings.model_fields and name not in skip and value is not None
    }
    try:
        return settings(**given)
    except ValidationError as e:
        raise SystemExit(f"loraplex {command}: {e}") from None
