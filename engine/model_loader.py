"""Loads a Hugging Face model directory (config.json, *.safetensors, tokenizer) or a GGUF file into our own model.

transformers reads the config and the tokenizer only; the weights go straight from safetensors (or, dequantized,
from the GGUF file: `engine.gguf_reader`) into the packed modules of `engine.models.llama`. Every failure names
the file or tensor at fault.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from engine.gguf_reader import is_gguf, read_gguf
from engine.models.arch import ModelArch, UnsupportedModelError
from engine.models.llama import LlamaForCausalLM, packed_modules

logger = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    pass


def load_arch(model_dir: str | Path) -> ModelArch:
    if is_gguf(model_dir):
        return read_gguf(model_dir).arch
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(f"cannot read {config_path}: {e}") from e
    return ModelArch.from_hf_config(config, str(config_path))


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    if is_gguf(model_dir):
        return read_gguf(model_dir).tokenizer
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"no usable tokenizer in {model_dir}: {e}") from e


def weight_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise WeightLoadError(f"{index} names weight files that are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        hint = " (only pickle .bin weights found; convert them to safetensors)" if any(model_dir.glob("*.bin")) else ""
        raise WeightLoadError(f"no *.safetensors weight files in {model_dir}{hint}")
    return files


def _target(model: LlamaForCausalLM, params: dict[str, torch.Tensor], name: str):
    """(our parameter name, row slice or None, shard index) that checkpoint tensor `name` fills."""
    for ckpt, (packed, shard) in packed_modules.items():
        if f".{ckpt}." in name:
            packed_name = name.replace(f".{ckpt}.", f".{packed}.")
            owner = model.get_submodule(packed_name.rsplit(".", 2)[0])  # the Attention or MLP module
            sizes = owner.output_slices if packed == "qkv_proj" else (owner.intermediate_size,) * 2
            start = sum(sizes[:shard])
            return packed_name, slice(start, start + sizes[shard]), shard
    return (name, None, 0) if name in params else None


def load_weights(model: LlamaForCausalLM, model_dir: str | Path) -> None:
    """Fills every parameter of `model` (on its device and dtype) from the directory's safetensors files, or from
    a GGUF file."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    filled: dict[str, set[int]] = {}  # our parameter -> shards filled
    tensors = _gguf_tensors(model_dir) if is_gguf(model_dir) else _safetensors_tensors(model_dir)
    for name, tensor, source in tensors:
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue
        target = _target(model, params, name)
        if target is None:
            logger.debug("ignoring tensor %s in %s", name, source.name)
            continue
        param_name, rows, shard = target
        _copy(params[param_name], rows, tensor, name, source)
        filled.setdefault(param_name, set()).add(shard)
    num_shards = {"qkv_proj": 3, "gate_up_proj": 2}
    missing = [n for n in params if len(filled.get(n, ())) < num_shards.get(n.rsplit(".", 2)[-2], 1)]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise WeightLoadError(f"weights missing from {model_dir}: {', '.join(missing[:5])}{more}")


def _safetensors_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(name, tensor, file) for every tensor of the directory's safetensors files."""
    files = weight_files(model_dir)
    total = sum(path.stat().st_size for path in files)
    with tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024) as bar:
        for path in files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        tensor = f.get_tensor(name)
                        bar.update(tensor.numel() * tensor.element_size())
                        yield name, tensor, path
            except SafetensorError as e:
                raise WeightLoadError(f"cannot read weight file {path} (truncated or corrupt?): {e}") from e


def _gguf_tensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(Hugging Face name, fp32 tensor, file) for every tensor of a GGUF file, dequantized one at a time."""
    gguf = read_gguf(path)
    for name, tensor in tqdm(gguf.tensors(), total=gguf.num_tensors, desc="loading weights", unit="tensor"):
        yield name, tensor, gguf.path


def _copy(param: torch.Tensor, rows: slice | None, tensor: torch.Tensor, name: str, path: Path) -> None:
    dst = param.data if rows is None else param.data[rows]
    if tensor.shape != dst.shape:
        raise WeightLoadError(
            f"tensor '{name}' in {path.name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str, attention_backend: str) -> LlamaForCausalLM:
    arch = load_arch(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, attention_backend)
    model = model.to_empty(device=device).to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        load_weights(model, model_dir)
    logger.info(
        "loaded %s from %s: %.1fM parameters, %s on %s",
        arch.architecture,
        model_dir,
        sum(p.numel() for p in model.parameters()) / 1e6,
        dtype,
        device,
    )
    return model.eval()
