"""AdapterConfig: a PEFT `adapter_config.json` read and checked, with peft's own target and pattern matching.

Module keys are full module names as peft sees them in the base model, e.g. `model.layers.0.self_attn.q_proj`.
Whatever changes the forward pass beyond `y += scaling * x A^T B^T` on q/k/v/o/gate/up/down is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.base_spec import LORA_MODULES

CONFIG_NAME = "adapter_config.json"
ALL_LINEAR = "all-linear"  # every linear layer but the LM head
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # what peft targets in the Llama family when target_modules is null
EMBEDDING_KEYS = ("model.embed_tokens", "lm_head")

# config keys that must be absent, null, false or empty: each changes what the adapter computes
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained extra modules (modules_to_save)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "use_qalora": "QALoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
    "arrow_config": "Arrow routing (arrow_config)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}


class AdapterError(ValueError):
    """A LoRA adapter that loraplex refuses; the message names the adapter, the tensor or key, and the problem."""


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # names (exact or dotted suffix), a regex (re.fullmatch), or ALL_LINEAR
    exclude_modules: tuple[str, ...] | str
    fan_in_fan_out: bool  # about the base weight's layout only; lora_A / lora_B are always nn.Linear-shaped
    base_model_name_or_path: str | None
    rank_pattern: dict[str, int]  # regex -> r, matched as peft does: re.match(rf"(.*\.)?({key})$", module key)
    alpha_pattern: dict[str, float]
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None

    def targets(self, key: str) -> bool:
        """Whether peft puts a LoRA on module `key` (peft's check_target_module_exists)."""
        if isinstance(self.exclude_modules, str):
            if re.fullmatch(self.exclude_modules, key):
                return False
        elif key in self.exclude_modules or any(key.endswith(f".{m}") for m in self.exclude_modules):
            return False
        targets = LORA_MODULES if self.target_modules == ALL_LINEAR else self.target_modules
        if isinstance(targets, str):
            return re.fullmatch(targets, key) is not None
        if key in targets:
            return True
        if not any(key.endswith(f".{t}") for t in targets):
            return False
        if not self.layers_to_transform:
            return True
        return self._layer_index(key) in self.layers_to_transform

    def _layer_index(self, key: str) -> int | None:
        patterns = (
            [r".*?\.[^.]*\.(?P<idx>\d+)\."]
            if not self.layers_pattern
            else [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in self.layers_pattern]
        )
        for pattern in patterns:
            if match := re.match(pattern, key):
                return int(match["idx"])
        return None

    def rank_for(self, key: str) -> int:
        return _pattern_value(self.rank_pattern, key, self.r)

    def alpha_for(self, key: str) -> float:
        return _pattern_value(self.alpha_pattern, key, self.lora_alpha)

    def scaling_for(self, key: str) -> float:
        r, alpha = self.rank_for(key), self.alpha_for(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """peft's get_pattern_key: the first pattern (in file order) that matches a dotted suffix of `key` wins."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def read_adapter_config(directory: str | Path, adapter: str) -> AdapterConfig:
    """Reads `directory/adapter_config.json`; `adapter` names the adapter in error messages."""
    raw = read_adapter_config_bytes(directory, adapter)
    return decode_adapter_config(raw, Path(directory) / CONFIG_NAME, adapter)


def read_adapter_config_bytes(directory: str | Path, adapter: str) -> bytes:
    """The bytes of `directory/adapter_config.json`, as `decode_adapter_config` takes them."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"adapter {adapter!r}: no {CONFIG_NAME} in {directory}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise AdapterError(f"adapter {adapter!r}: cannot read {path}: {e}") from e


def decode_adapter_config(raw: bytes, path: Path, adapter: str) -> AdapterConfig:
    """The config in `raw`, the bytes of the adapter_config.json at `path`."""
    try:
        data = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter {adapter!r}: {path} is not valid JSON: {e}") from e
    return parse_adapter_config(data, adapter)


def parse_adapter_config(data: Any, adapter: str) -> AdapterConfig:
    def fail(problem: str) -> AdapterError:
        return AdapterError(f"adapter {adapter!r}: {CONFIG_NAME} {problem}")

    if not isinstance(data, dict):
        raise fail(f"must hold a JSON object, not {type(data).__name__}")
    if data.get("peft_type", "LORA") != "LORA":
        raise fail(f"has peft_type {data['peft_type']!r}; only LORA adapters are supported")
    for key, what in UNSUPPORTED.items():
        if data.get(key):
            raise fail(f"asks for {what}, which loraplex does not support")
    if data.get("bias", "none") != "none":
        raise fail(f"has bias={data['bias']!r}; only bias='none' is supported (trained base biases are not served)")
    r = _positive_int(data.get("r", 8), "r", fail)
    alpha = _number(data.get("lora_alpha", 8), "lora_alpha", fail)
    rank_pattern = {k: _positive_int(v, f"rank_pattern[{k!r}]", fail) for k, v in _dict(data, "rank_pattern", fail)}
    alpha_pattern = {k: _number(v, f"alpha_pattern[{k!r}]", fail) for k, v in _dict(data, "alpha_pattern", fail)}
    for pattern in [*rank_pattern, *alpha_pattern]:
        _regex(rf"(.*\.)?({pattern})$", f"pattern {pattern!r}", fail)
    layers_pattern = _names(data.get("layers_pattern"), "layers_pattern", fail, as_tuple=True) or None
    for pattern in layers_pattern or ():
        _regex(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", f"layers_pattern {pattern!r}", fail)
    config = AdapterConfig(
        r=r,
        lora_alpha=alpha,
        use_rslora=bool(data.get("use_rslora", False)),
        target_modules=_names(data.get("target_modules"), "target_modules", fail) or PEFT_DEFAULT_TARGETS,
        exclude_modules=_names(data.get("exclude_modules"), "exclude_modules", fail) or (),
        fan_in_fan_out=bool(data.get("fan_in_fan_out", False)),
        base_model_name_or_path=data.get("base_model_name_or_path") or None,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        layers_to_transform=_layers(data.get("layers_to_transform"), fail),
        layers_pattern=layers_pattern,
    )
    for key in EMBEDDING_KEYS:
        if config.targets(key):
            module = key.rsplit(".", 1)[-1]
            raise fail(f"targets {module}; only {', '.join(LORA_MODULES)} are supported")
    return config


def _positive_int(value: Any, what: str, fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise fail(f"has {what}={value!r}; it must be a positive integer")
    return value


def _number(value: Any, what: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise fail(f"has {what}={value!r}; it must be a finite number")
    return float(value)


def _dict(data: dict, key: str, fail) -> list[tuple[str, Any]]:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise fail(f"has {key} of type {type(value).__name__}; it must be an object")
    return list(value.items())


def _regex(pattern: str, what: str, fail) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise fail(f"has {what} that is not a valid regular expression: {e}") from e


def _names(value: Any, key: str, fail, as_tuple: bool = False) -> tuple[str, ...] | str | None:
    """A list of names (a tuple), or one string: a regex for target/exclude_modules, a name for layers_pattern."""
    if value is None:
        return None
    if isinstance(value, str):
        if as_tuple:
            return (value,)
        if value.lower() == ALL_LINEAR:
            return ALL_LINEAR
        _regex(value, key, fail)
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise fail(f"has {key}={value!r}; it must be a string or a list of strings")


def _layers(value: Any, fail) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise fail(f"has layers_to_transform={value!r}; it must be an integer or a list of integers")
    return tuple(values)
