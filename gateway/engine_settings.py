"""EngineSettings: the engine's options as settings, generated from EngineConfig's `option(...)` fields.

One setting per option, with EngineConfig's name, type, default and help: `LORAPLEX_MAX_LORA_RANK`, `--max-lora-rank`.
A `choices` option takes only those values; a `size` option also takes units (2GiB, 512MiB). `loraplex serve` has them
through ServeSettings (a subclass), `loraplex generate` through this class; both build their EngineConfig with
`engine_config`, so an option's default is EngineConfig's everywhere.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, create_model
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.interface import EngineConfig

ENV_PREFIX = "LORAPLEX_"
ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig) if "help" in f.metadata)


def parse_size(value: str | int | None) -> int | None:
    """'2GiB', '512MiB', '1G', '1000000' -> bytes."""
    if value is None or isinstance(value, int):
        return value
    text = value.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise ValueError(f"invalid size {value!r}: use bytes or a unit, e.g. 2GiB or 512MiB") from None


def _setting(option: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    """(type, pydantic Field) of the setting made from one EngineConfig option."""
    if option.metadata["choices"]:
        annotation = Literal[option.metadata["choices"]]
    if option.metadata["size"]:
        annotation = Annotated[annotation, BeforeValidator(parse_size)]
    return annotation, Field(option.default, description=option.metadata["help"])


class _EngineSettingsBase(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=())

    def engine_options(self) -> dict[str, Any]:
        """EngineConfig's keyword arguments for every option (the caller adds model and enable_lora)."""
        return {name: getattr(self, name) for name in ENGINE_OPTIONS}

    def engine_config(self, model: str, enable_lora: bool) -> EngineConfig:
        """The EngineConfig these settings describe, for `model` (checked and resolved by EngineConfig)."""
        return EngineConfig(model=model, enable_lora=enable_lora, **self.engine_options())


_hints = typing.get_type_hints(EngineConfig)
EngineSettings = create_model(
    "EngineSettings",
    __base__=_EngineSettingsBase,
    __module__=__name__,
    **{f.name: _setting(f, _hints[f.name]) for f in dataclasses.fields(EngineConfig) if f.name in ENGINE_OPTIONS},
)
