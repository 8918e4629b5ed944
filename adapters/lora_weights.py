"""load_lora: a PEFT LoRA directory read into fp32 (A, B, scaling) per (layer, module), after checking all of it.

Nothing is returned, so nothing reaches a device, unless every check passed: files, config, tensor names, shapes
against the base model (first, so an adapter for another base is named as such), pairs, ranks, finiteness, a sane
scaling, and agreement between the tensors and adapter_config.json.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from adapters.base_spec import MODULE_PARENTS, BaseModelSpec
from adapters.content_digest import FileIdentity, content_digest, settled_identity
from adapters.file_layout import LAYOUTS, layout_key, layout_of, payload_start
from adapters.peft_config import (
    CONFIG_NAME,
    AdapterConfig,
    AdapterError,
    decode_adapter_config,
    read_adapter_config_bytes,
)

logger = logging.getLogger(__name__)

SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
# PEFT's scaling is lora_alpha / r (or / sqrt(r) with rsLoRA): 1 to 2 as usually trained, a few hundred at most (alpha
# 256 at rank 1). Beyond 1000 the delta outweighs the base layer by orders of magnitude, a mistake or an attack, and
# scaling * lora_B, folded into the stacked weights in the serving dtype (float16 ends at 65504), may overflow.
MAX_LORA_SCALING = 1000.0
# The stored dtypes whose values numpy reads straight from a safetensors file's (little-endian) bytes, and float32
# holds exactly
PAYLOAD_DTYPES = {torch.float32: np.dtype("<f4"), torch.float16: np.dtype("<f2")}

# base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight, with or without `.default` before `.weight`
LORA_TENSOR = re.compile(
    r"(?:base_model\.model\.)?(?P<key>(?P<prefix>(?:.*\.)?)layers\.(?P<layer>\d+)\.[^.]+\.(?P<module>[^.]+))"
    r"\.(?P<ab>lora_A|lora_B)(?:\.default)?\.weight"
)


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    name: str
    path: str
    rank: int  # the largest rank over modules
    digest: str  # "sha256:<hex>": the adapter's content identity
    target_modules: frozenset[str]  # module names present, e.g. {"q_proj", "v_proj"}
    num_bytes: int  # of its fp32 A and B tensors (as `weights` holds them when read)
    alpha: float  # the config's lora_alpha (each module's scaling is in `weights`)
    base_model_name: str | None  # the config's base_model_name_or_path
    # (layer, module) -> (A [r, in] fp32, B [out, r] fp32, scaling): delta(x) = scaling * x @ A.T @ B.T
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    largest: float  # the largest |value| of any A or B (all finite): whether a serving dtype holds them


def load_lora(
    path: str | Path, spec: BaseModelSpec, max_lora_rank: int, allow_pickle: bool = False, name: str | None = None
) -> LoRAWeights:
    """Reads and validates the PEFT LoRA adapter in directory `path`; raises AdapterError naming any problem."""
    directory = Path(path)
    label = name or str(path)
    if not directory.is_dir():
        raise AdapterError(f"adapter {label!r}: {path} is not a directory")
    config_bytes = read_adapter_config_bytes(directory, label)
    config = decode_adapter_config(config_bytes, directory / CONFIG_NAME, label)
    _check_base_name(config, spec, label)
    data, weights_file = _read_safetensors_file(directory, label)
    key = layout_key(spec, max_lora_rank, config_bytes, data) if data is not None else None
    layout = LAYOUTS.get(key) if key is not None else None
    read = layout.read(data) if layout is not None else None
    if read is not None and math.isfinite(largest := _largest(read[2])):  # the checks passed for this layout before
        tensors, weights, _ = read
        pairs = layout.pairs
    else:
        stored, payload, pickle_file = _stored_tensors(directory, data, label, allow_pickle)
        if data is None:
            weights_file = pickle_file
        tensors, pairs, prefix, renamed = _pair_tensors(stored, spec, label)
        _check_targets(config, set(pairs.values()), prefix, spec, label)
        weights, largest = _checked_weights(tensors, pairs, config, max_lora_rank, label, payload)
        if payload is not None and key is not None:
            scalings = {module: scaling for module, (_, _, scaling) in weights.items()}
            kept = layout_of(data, _header(data), renamed, pairs, scalings, next(iter(stored.values())).dtype)
            if kept is not None:
                LAYOUTS.put(key, kept)
    return LoRAWeights(
        name=name if name is not None else directory.name,
        path=str(path),
        rank=max(a.shape[0] for a, _, _ in weights.values()),
        digest=content_digest(tensors, {pairs[k]: s for k, (_, _, s) in weights.items()}, weights_file),
        target_modules=frozenset(module for _, module in weights),
        num_bytes=sum(a.nbytes + b.nbytes for a, b, _ in weights.values()),
        alpha=float(config.lora_alpha),
        base_model_name=config.base_model_name_or_path,
        weights=weights,
        largest=largest,
    )


def _read_safetensors_file(directory: Path, label: str) -> tuple[bytes | None, FileIdentity | None]:
    """The whole safetensors file (None where there is none) and its identity when it did not change while it was
    read (see adapters/content_digest.py). One read: an adapter is small, and its hundreds of tensors tiny."""
    path = directory / SAFETENSORS_NAME
    if not path.is_file():
        return None, None
    try:
        with open(path, "rb") as f:
            before, data, after = os.fstat(f.fileno()), f.read(), os.fstat(f.fileno())
    except OSError as e:
        raise AdapterError(f"adapter {label!r}: cannot read {path}: {e}") from e
    return data, settled_identity(before, after)


def _header(data: bytes) -> dict:
    """The parsed header of a safetensors file the library has read (so it is whole, and JSON)."""
    return json.loads(data[8 : payload_start(data)])


def _stored_tensors(
    directory: Path, data: bytes | None, label: str, allow_pickle: bool
) -> tuple[dict[str, torch.Tensor], np.ndarray | None, FileIdentity | None]:
    """Stored tensor name -> tensor, from the safetensors file's bytes `data`, else (if allowed) the pickle; every
    tensor's values in one array where `_payload` can give it; the pickle's identity, when it was read and did not
    change meanwhile."""
    safetensors_path, pickle_path = directory / SAFETENSORS_NAME, directory / PICKLE_NAME
    payload = pickle_file = None
    if data is not None:
        try:
            stored = dict(sorted(load_safetensors(data).items()))  # by name, as safe_open
            payload = _payload(data, stored)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise AdapterError(f"adapter {label!r}: cannot read {safetensors_path}: {e}") from e
    elif pickle_path.is_file():
        if not allow_pickle:
            raise AdapterError(
                f"adapter {label!r}: has only pickle weights ({PICKLE_NAME}), which can run code when loaded; "
                f"convert them to {SAFETENSORS_NAME}, or have the operator allow pickles"
            )
        try:
            with open(pickle_path, "rb") as f:
                before = os.fstat(f.fileno())
                stored = torch.load(f, map_location="cpu", weights_only=True)
                pickle_file = settled_identity(before, os.fstat(f.fileno()))
        except Exception as e:  # a pickle fails in many ways; each one means the same: a bad file
            raise AdapterError(f"adapter {label!r}: cannot read {pickle_path}: {e}") from e
        if not isinstance(stored, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in stored.items()
        ):
            raise AdapterError(f"adapter {label!r}: {pickle_path} is not a dictionary of named tensors")
    else:
        raise AdapterError(f"adapter {label!r}: no weights file ({SAFETENSORS_NAME}) in {directory}")
    if not stored:
        raise AdapterError(f"adapter {label!r}: the weights file holds no tensors")
    return stored, payload, pickle_file


def _payload(data: bytes, stored: dict[str, torch.Tensor]) -> np.ndarray | None:
    """The values of every tensor of the safetensors file `data` (which `stored` holds, as read) as one array, a view
    of the file's bytes, when they share a dtype of PAYLOAD_DTYPES; else None. A safetensors file is an 8-byte header
    length, the header, then the tensors' bytes with no gap between them (the library refuses a file with a hole), so
    one pass over the array checks them all: an adapter holds hundreds of small tensors, and a call for each cost
    more than the pass (W1's rank-8 adapter on all modules, 112 tensors, one thread: 0.51 ms against 0.22)."""
    dtypes = {t.dtype for t in stored.values()}
    dtype = PAYLOAD_DTYPES.get(dtypes.pop()) if len(dtypes) == 1 else None
    if dtype is None:  # (the library has parsed `data`: it holds the 8 bytes of its header's length)
        return None
    start = payload_start(data)
    size, extra = divmod(len(data) - start, dtype.itemsize)
    if extra or size != sum(t.numel() for t in stored.values()):
        return None
    return np.frombuffer(data, dtype, count=size, offset=start)


def _pair_tensors(
    stored: dict[str, torch.Tensor], spec: BaseModelSpec, label: str
) -> tuple[dict[str, torch.Tensor], dict[tuple[int, str], str], str, dict[str, str]]:
    """Tensors renamed to `<module key>.lora_A|B`; (layer, module) -> module key; the keys' prefix ("model."); stored
    name -> new name."""
    tensors: dict[str, torch.Tensor] = {}
    renamed: dict[str, str] = {}
    pairs: dict[tuple[int, str], str] = {}
    halves: dict[str, set[str]] = {}
    prefixes = set()
    matches = []
    for stored_name, tensor in stored.items():
        match = LORA_TENSOR.fullmatch(stored_name)
        if match is None:
            raise AdapterError(f"adapter {label!r}: tensor {stored_name} {_why_unsupported(stored_name)}")
        name = f"{match['key']}.{match['ab']}"
        if name in tensors:
            raise AdapterError(f"adapter {label!r}: tensor {name} is stored twice (with and without '.default')")
        tensors[name] = tensor
        renamed[stored_name] = name
        if match["module"] not in spec.module_shapes:
            known = ", ".join(spec.module_shapes)
            raise AdapterError(
                f"adapter {label!r}: {name} is on module {match['module']}; LoRA is supported on {known}"
            )
        _check_shape(name, tensor, match["module"], match["ab"], spec, label)
        matches.append((name, match))
    for name, match in matches:  # after every shape: an adapter for another base is named so, not by its depth
        module, layer = match["module"], int(match["layer"])
        if layer >= spec.num_layers:
            raise AdapterError(
                f"adapter {label!r}: {name} is in layer {layer}, but the base model has {spec.num_layers} layers"
            )
        pairs[layer, module] = match["key"]
        halves.setdefault(match["key"], set()).add(match["ab"])
        prefixes.add(match["prefix"])
    for key, found in sorted(halves.items()):
        if len(found) < 2:
            missing = ({"lora_A", "lora_B"} - found).pop()
            raise AdapterError(f"adapter {label!r}: {key} has {found.pop()} but no {missing}")
    if len(set(pairs.values())) != len(pairs) or len(prefixes) != 1:
        raise AdapterError(f"adapter {label!r}: tensor names do not follow one layout: {sorted(stored)[:4]} ...")
    return tensors, pairs, prefixes.pop(), renamed


def _check_shape(name: str, t: torch.Tensor, module: str, ab: str, spec: BaseModelSpec, label: str) -> None:
    """A floating point matrix whose base side (lora_A's inputs, lora_B's outputs) fits the base model's module."""
    if not t.is_floating_point() or t.ndim != 2:
        raise AdapterError(
            f"adapter {label!r}: {name} has dtype {t.dtype} and shape {tuple(t.shape)}; it must be a floating point "
            "matrix"
        )
    in_features, out_features = spec.module_shapes[module]
    if ab == "lora_A" and t.shape[1] != in_features:
        raise AdapterError(
            f"adapter {label!r}: {name} has shape {tuple(t.shape)}, the base model's {module} takes {in_features} "
            f"inputs, not {t.shape[1]}: the adapter was made for another base model"
        )
    if ab == "lora_B" and t.shape[0] != out_features:
        raise AdapterError(
            f"adapter {label!r}: {name} has shape {tuple(t.shape)}, the base model's {module} gives {out_features} "
            f"outputs, not {t.shape[0]}: the adapter was made for another base model"
        )


def _why_unsupported(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return "is a DoRA magnitude vector; DoRA is not supported"
    if "lora_embedding_" in name:
        return "is an embedding LoRA; LoRA on embeddings is not supported"
    if "modules_to_save" in name:
        return "is a fully trained module (modules_to_save), which is not supported"
    if "lm_head" in name or "embed_tokens" in name:
        return "targets the embeddings or the LM head; LoRA is supported on linear layers inside the blocks only"
    if name.endswith(".bias"):
        return "is a bias; adapters that train biases are not supported"
    return "is not a lora_A / lora_B weight of a module of the base model"


def _check_targets(config: AdapterConfig, keys: set[str], prefix: str, spec: BaseModelSpec, label: str) -> None:
    """The weights hold exactly the modules that adapter_config.json targets, as peft would load them."""
    for key in sorted(keys):
        if not config.targets(key):
            raise AdapterError(f"adapter {label!r}: {key} has LoRA weights, but adapter_config.json does not target it")
    for layer in range(spec.num_layers):
        for module in spec.module_shapes:
            key = f"{prefix}layers.{layer}.{MODULE_PARENTS.get(module, 'mlp')}.{module}"
            if key not in keys and config.targets(key):
                raise AdapterError(f"adapter {label!r}: adapter_config.json targets {key}, but no weights are given")


def _checked_weights(
    tensors: dict[str, torch.Tensor],
    pairs: dict[tuple[int, str], str],
    config: AdapterConfig,
    max_lora_rank: int,
    label: str,
    payload: np.ndarray | None,
) -> tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]], float]:
    """(A, B, scaling) per (layer, module) in module order, and the largest |value| of any A or B: from `payload`
    (every stored tensor's values, see `_payload`) when given, in one pass; each tensor's own where that is not
    finite (to name the tensor) or not given."""
    weights = {}
    for (layer, module), key in sorted(pairs.items()):

        def fail(problem: str, key: str = key) -> AdapterError:
            return AdapterError(f"adapter {label!r}: {key}.{problem}")

        a, b = _checked_pair(tensors[f"{key}.lora_A"], tensors[f"{key}.lora_B"], fail)
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise fail(f"lora_A has rank {rank}, above the server's max_lora_rank {max_lora_rank}")
        if rank != config.rank_for(key):
            raise fail(f"lora_A has rank {rank}, but adapter_config.json gives r={config.rank_for(key)} for it")
        weights[layer, module] = a, b, _checked_scaling(config, key, label)
    if payload is not None and math.isfinite(largest := _largest(payload)):
        return weights, largest
    each = magnitudes([t for a, b, _ in weights.values() for t in (a, b)])  # weights: in module order
    bad = next((i for i, m in enumerate(each) if not math.isfinite(m)), None)
    if bad is not None:
        key, ab = pairs[list(weights)[bad // 2]], ("lora_A", "lora_B")[bad % 2]
        raise AdapterError(f"adapter {label!r}: {key}.{ab} holds NaN or Inf values")
    return weights, max(each, default=0.0)


def _largest(values: np.ndarray) -> float:
    """The largest |value| of the array, as `magnitudes` gives a tensor's; no copy."""
    return _largest_of(float(values.min()), float(values.max())) if values.size else 0.0  # NaN carries through both


def magnitudes(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's largest |value|: NaN when it holds a NaN, inf when an Inf (aminmax carries both), 0 when empty.
    One pass over each tensor and no copy: an adapter has hundreds of small ones, read while the engine runs."""
    return [_largest_of(*(float(x) for x in torch.aminmax(t))) if t.numel() else 0.0 for t in tensors]


def _largest_of(low: float, high: float) -> float:
    """The largest |value| between a smallest `low` and a largest `high`: NaN when either is."""
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def _checked_scaling(config: AdapterConfig, key: str, label: str) -> float:
    scaling = config.scaling_for(key)
    if not abs(scaling) <= MAX_LORA_SCALING:  # NaN fails too
        r, alpha = config.rank_for(key), config.alpha_for(key)
        formula = (
            f"lora_alpha / sqrt(r) = {alpha:g} / sqrt({r})"
            if config.use_rslora
            else f"lora_alpha / r = {alpha:g} / {r}"
        )
        raise AdapterError(
            f"adapter {label!r}: {key} has scaling {formula} = {scaling:g}; loraplex serves scalings up to "
            f"{MAX_LORA_SCALING:g} in magnitude (a larger one swamps the base model, or overflows)"
        )
    return scaling


def _checked_pair(lora_a: torch.Tensor, lora_b: torch.Tensor, fail) -> tuple[torch.Tensor, torch.Tensor]:
    """A [r, in] and B [out, r] (their base sides already checked) as fp32, once their ranks agree (finiteness is
    checked over all pairs at once, by `_checked_weights`)."""
    if lora_b.shape[1] != lora_a.shape[0]:
        raise fail(f"lora_B has shape {tuple(lora_b.shape)}, its rank differs from lora_A's {lora_a.shape[0]}")
    return lora_a.to(torch.float32).contiguous(), lora_b.to(torch.float32).contiguous()


def _same_model_name(a: str, b: str) -> bool:
    """'SmolLM2-135M-Instruct' names 'SmolLM2-135M-Instruct.Q4_1.gguf' too."""
    return a.startswith(b) or b.startswith(a)


def _check_base_name(config: AdapterConfig, spec: BaseModelSpec, label: str) -> None:
    """Names differ across machines (paths, mirrors, a GGUF file named after its model and quantization), so a
    mismatch is only logged; the shapes are the real check."""
    theirs, ours = config.base_model_name_or_path, spec.base_model_name
    if theirs and ours and not _same_model_name(Path(theirs).name, Path(ours).name):
        logger.warning("adapter %r was trained on %r, the base model here is %r", label, theirs, ours)
