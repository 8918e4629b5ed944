"""ServeSettings: every option of `loraplex serve`, from the command line or `LORAPLEX_*` environment variables.

Precedence: command-line flag > environment variable > default. List options take JSON in the environment,
e.g. `LORAPLEX_LORA_MODULES='["sql=/adapters/sql"]'`.
"""

from __future__ import annotations

import hashlib
import os
import re
from functools import cached_property
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "LORAPLEX_"
DEMO_MODEL_NAME = "loraplex-demo"


def default_database_url(served_model: str) -> str:
    """A SQLite file per served model: adapters registered against one base never show up under another."""
    data = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share"))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", served_model).strip("_.")[-48:] or "model"
    digest = hashlib.sha256(served_model.encode()).hexdigest()[:8]
    return f"sqlite:///{data / 'loraplex' / f'registry-{slug}-{digest}.db'}"


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


class ServeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", protected_namespaces=())

    model: str | None = Field(None, description="a Hugging Face model directory; default: the embedded demo")
    served_model_name: str | None = Field(
        None, description="the name clients use for the base model (default: --model as given, or loraplex-demo)"
    )
    lora_modules: list[str] = Field(
        default_factory=list,
        description="adapters registered (public) at startup: name=path or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}',
    )
    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0 for every interface)")
    port: int = Field(8000, description="port to listen on")
    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    device: str = Field("auto", description="auto | cpu | cuda[:N]")
    kv_cache_memory: str | None = Field(None, description="KV pool size, e.g. 2GiB (CPU default 1GiB)")
    max_num_seqs: int = Field(128, description="most sequences in one step")
    max_num_batched_tokens: int = Field(2048, description="most tokens in one step")
    max_model_len: int | None = Field(None, description="context length limit (default: the model's)")
    max_loras: int = Field(4, description="adapters resident on the device at once (rows of stacked weights)")
    max_lora_rank: int = Field(16, description="highest adapter rank accepted")
    max_cpu_loras: int | None = Field(None, description="adapters kept in host memory (default 4 x max-loras)")
    allow_pickle_adapters: bool = Field(False, description="accept adapter_model.bin (loaded with weights_only)")
    database_url: str | None = Field(
        None,
        description="registry database: sqlite:///FILE or postgresql://... (default: a SQLite file per served "
        "model under ~/.local/share/loraplex)",
    )
    adapter_root: list[str] = Field(
        default_factory=list, description="directories adapters may be registered from (repeatable)"
    )
    admin_key: str | None = Field(None, description="credential for /admin/* (the admin API is off without it)")
    disable_auth: bool | None = Field(
        None, description="serve /v1/* without API keys (default: off for the demo, on with --model)"
    )
    redis_url: str | None = Field(
        None, description="Redis for usage counters and limits shared by several gateways (default: in process)"
    )
    redis_key_prefix: str = Field("loraplex:", description="prefix of every Redis key (deployments sharing a Redis)")
    limits_fail_open: bool = Field(True, description="while Redis is unreachable, admit requests (else answer 503)")
    usage_flush_interval: float = Field(10.0, description="seconds between usage flushes into the registry")
    chat_template: str | None = Field(None, description="a Jinja chat template, inline or a file path")
    timeout_graceful_shutdown: float = Field(30.0, description="seconds running requests get to finish on exit")
    seed: int = Field(0, description="engine seed for unseeded sampling")
    log_level: str = Field("info", description="debug | info | warning | error")

    @model_validator(mode="after")
    def _default_database(self) -> ServeSettings:
        if self.database_url is None:
            self.database_url = default_database_url(self.base_model_name)
        return self

    @property
    def base_model_name(self) -> str:
        """The name clients use for the base model."""
        return self.served_model_name or self.model or DEMO_MODEL_NAME

    @property
    def is_demo(self) -> bool:
        return self.model is None

    @property
    def auth_enabled(self) -> bool:
        return not (self.disable_auth if self.disable_auth is not None else self.is_demo)

    @cached_property
    def kv_cache_bytes(self) -> int | None:
        return parse_size(self.kv_cache_memory)
