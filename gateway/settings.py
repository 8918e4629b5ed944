"""ServeSettings: every option of `loraplex serve`, from the command line or `LORAPLEX_*` environment variables: the
server's own, declared here, and the engine's, inherited from EngineSettings (generated from EngineConfig).

Precedence: command-line flag > environment variable > default. List options take JSON in the environment,
e.g. `LORAPLEX_LORA_MODULES='["sql=/adapters/sql"]'`.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from gateway.engine_settings import ENGINE_OPTIONS, ENV_PREFIX, EngineSettings, parse_size

__all__ = ["ENGINE_OPTIONS", "ENV_PREFIX", "ServeSettings", "default_database_url", "parse_size"]
DEMO_MODEL_NAME = "loraplex-demo"  # the base's name before the command fills in the demo (loraplex.cli.with_demo)


def default_database_url(served_model: str) -> str:
    """A SQLite file per served model: adapters registered against one base never show up under another."""
    data = Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share"))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", served_model).strip("_.")[-48:] or "model"
    digest = hashlib.sha256(served_model.encode()).hexdigest()[:8]
    return f"sqlite:///{data / 'loraplex' / f'registry-{slug}-{digest}.db'}"


class ServeSettings(EngineSettings):
    model: str | None = Field(
        None, description="a Hugging Face model directory or a GGUF file; default: the embedded demo"
    )
    served_model_name: str | None = Field(
        None, description="the name clients use for the base model (default: --model as given, or the demo's)"
    )
    lora_modules: list[str] = Field(
        default_factory=list,
        description="adapters registered (public) at startup: name=path or vLLM's JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}',
    )
    preload: bool = Field(
        False,
        description="load every --lora-modules adapter into host memory and a device row at startup, so no first "
        "request waits for its load",
    )
    host: str = Field("127.0.0.1", description="address to bind (0.0.0.0 for every interface)")
    port: int = Field(8000, description="port to listen on")
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
    timeout_graceful_shutdown: float = Field(
        30.0, description="seconds running requests get to finish on SIGTERM; streams still open then get an error"
    )
    # ---- limits on one request (the event loop and the engine stay responsive whatever a body holds) ----
    max_request_body_bytes: Annotated[int, BeforeValidator(parse_size)] = Field(
        4 * 2**20, description="largest request body accepted (413 above it), e.g. 4MiB"
    )
    max_prompt_tokens: int | None = Field(
        None, description="longest prompt accepted, in tokens (default: the model's context length)"
    )
    max_n: int = Field(128, description="largest `n` (samples per prompt) a request may ask for")
    max_sequences_per_request: int = Field(1024, description="most sequences (prompts x n) one request may start")
    trust_request_chat_template: bool = Field(
        False, description="accept a per-request `chat_template` (vLLM's flag; off: such a request is a 400)"
    )
    chat_template_timeout: float = Field(
        5.0, description="seconds a chat template may take to render before the request gets a 400"
    )
    enable_auto_tool_choice: bool = Field(
        False, description="serve tool_choice 'auto' (vLLM's flag; needs --tool-call-parser): the model decides"
    )
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = Field(
        None,
        description="the model's own tool-call syntax, for tool_choice 'auto': hermes (Hermes, Qwen2.5, Qwen3), "
        "llama3_json (Llama 3.1/3.2 JSON calls), pythonic (Llama 3.2/4 [f(x=1)] calls), mistral ([TOOL_CALLS])",
    )
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = Field(
        None,
        description="split the model's <think>...</think> reasoning off the chat reply, as `reasoning` "
        "(vLLM's flag): deepseek_r1 (DeepSeek-R1, QwQ: it reasons from the start) or qwen3",
    )
    metrics_key: str | None = Field(
        None,
        description="credential for /metrics (a scrape-only key); the admin key works too. With neither set, "
        "/metrics answers loopback clients only",
    )
    log_level: str = Field("info", description="debug | info | warning | error")
    # ---- scale-out on Ray Serve (gateway/cluster; needs the `ray` extra) ----
    replicas: int = Field(
        0,
        ge=0,
        description="engine replicas on Ray Serve behind this gateway, routed by adapter (0: one process, no Ray)",
    )
    ray_address: str | None = Field(
        None, description="with --replicas: the Ray cluster to join (e.g. auto); default: start a local Ray instance"
    )
    replica_num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each engine replica")
    replica_num_gpus: float | None = Field(
        None,
        ge=0,
        description="GPUs Ray reserves for each engine replica (default: 1 with --device cuda or, with --device "
        "auto, where this machine has CUDA; else 0. Set it when the GPUs are on other nodes)",
    )
    ingress_replicas: int = Field(1, ge=1, description="with --replicas: gateway (HTTP ingress) replicas on Ray")
    replica_routing: Literal["adapter", "round-robin"] = Field(
        "adapter",
        description="with --replicas: adapter (Ray's multiplexed routing: replicas holding the adapter first) or "
        "round-robin (the baseline for `loraplex bench replicas`)",
    )
    adapter_cache_dir: str | None = Field(
        None,
        description="where an engine replica writes the adapters it fetches from the registry database by content "
        "digest (default $XDG_CACHE_HOME/loraplex/adapters, else ~/.cache/loraplex/adapters)",
    )

    @model_validator(mode="after")
    def _auto_tool_choice_has_a_parser(self) -> ServeSettings:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "--enable-auto-tool-choice needs --tool-call-parser (the model's call syntax: hermes, llama3_json, "
                "mistral or pythonic)"
            )
        return self

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
