"""Reads a GGUF file (llama.cpp's one-file model format) into what a Hugging Face model directory would give.

Owns: a GGUF file -> its Hugging Face config (a dict as in config.json, and our `ModelArch`), its tokenizer (chat
template, bos and eos set), the token ids that end a generation, and its tensors under Hugging Face names,
dequantized to fp32 one at a time, with llama.cpp's row permutation of Q and K undone. The `gguf` package reads
the file and dequantizes; transformers only converts the tokenizer metadata (its GGUF tokenizer converter).

    gguf = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    gguf.config            # {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, ...}
    gguf.tokenizer         # PreTrainedTokenizerFast, chat_template set
    gguf.state_dict()      # {"model.embed_tokens.weight": fp32 [49152, 576], ...}: a tied lm_head is left out
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**gguf.config))
    model.load_state_dict(gguf.state_dict(), strict=False)  # only a tied lm_head.weight is missing

Architectures: GGUF `llama` (Llama, Mistral and SmolLM files; served as LlamaForCausalLM), `qwen2`, `qwen3`.
Tensor types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q2_K..Q6_K. Anything else (another
architecture, type or tensor, llama3-style `rope_freqs`) is an `UnsupportedModelError` naming it and the file; a
truncated or foreign file is a `GGUFError` naming the file. A file's header is parsed once (`GGUFReader` is slow
on a large vocabulary) and kept for the next `read_gguf` of the same, unchanged file.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from engine.models.arch import ModelArch, UnsupportedModelError

logger = logging.getLogger(__name__)

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ARCH_BLOCK_NAMES = {
    "llama": {},
    "qwen2": {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
}
END_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class GGUFError(ValueError):
    """Not a GGUF file, or a truncated or corrupt one."""


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


@dataclass(frozen=True)
class GGUFModel:
    path: Path
    gguf_architecture: str  # general.architecture: "llama" | "qwen2" | "qwen3"
    config: dict[str, Any]  # as in a Hugging Face config.json
    arch: ModelArch
    bos_token_id: int | None
    eos_token_ids: list[int]  # eos, then end-of-turn and end-of-message when the file names them
    chat_template: str | None
    tensor_names: dict[str, str]  # GGUF name -> Hugging Face name, in file order
    _tensors: tuple[ReaderTensor, ...] = field(repr=False)

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        """Built by transformers' GGUF tokenizer converter from the metadata (vocabulary, merges, special tokens)."""
        from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

        try:
            architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(self.path))
            backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
        except (ValueError, KeyError, IndexError) as e:
            raise GGUFError(f"cannot build the tokenizer of {self.path}: {e}") from e
        backend = _within_vocabulary(backend, self.arch.vocab_size, self.path)
        # tokenizer_config: chat_template, add_bos_token, bos/eos/unk/pad tokens, as transformers' own loader sets
        return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(self.path), **tokenizer_config)

    @property
    def num_tensors(self) -> int:
        return len(self._tensors)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, fp32 tensor in Hugging Face's shape) for each tensor, in file order, one at a time."""
        for tensor in self._tensors:
            name = self.tensor_names[tensor.name]
            yield name, self._hf_layout(name, _dequantize(tensor))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor as a Hugging Face checkpoint holds it (fp32; no lm_head.weight when tied)."""
        return dict(self.tensors())

    def _hf_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.gguf_architecture != "llama":
            return tensor
        if ".q_proj." in name:
            return reverse_permute(tensor, self.arch.num_heads)
        if ".k_proj." in name:
            return reverse_permute(tensor, self.arch.num_kv_heads)
        return tensor


def reverse_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's `permute` of Q/K rows for the llama architecture.

    llama.cpp stores each head's rows as interleaved rotary pairs [head, dim/2, 2]; Hugging Face rotates halves,
    [head, 2, dim/2]. weight: [num_heads * head_dim, in] (or a bias [num_heads * head_dim]).
    """
    rows = weight.shape[0]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])  # [H, D/2, 2, in]
    return pairs.transpose(1, 2).reshape(weight.shape).contiguous()  # [H, 2, D/2, in] -> [H*D, in]


def _within_vocabulary(backend: Tokenizer, vocab_size: int, path: Path) -> Tokenizer:
    """Drops added tokens past the model's embedding rows: transformers' byte-level builder adds GPT-2's
    "<|endoftext|>" to a vocabulary that lacks it (Llama 3's), which llama.cpp would read as plain text."""
    spec = json.loads(backend.to_str())
    extra = [token["content"] for token in spec["added_tokens"] if token["id"] >= vocab_size]
    if not extra:
        return backend
    logger.info("%s: dropping tokens beyond the vocabulary of %d: %s", path.name, vocab_size, ", ".join(extra))
    spec["added_tokens"] = [token for token in spec["added_tokens"] if token["id"] < vocab_size]
    return Tokenizer.from_str(json.dumps(spec))


def read_gguf(path: str | Path) -> GGUFModel:
    """Reads and checks a GGUF file's header; tensors are dequantized only when iterated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    metadata, tensors = _parse(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    gguf_arch = metadata.get("general.architecture")
    if gguf_arch is None:
        raise GGUFError(f"{path} has no general.architecture in its metadata")
    if gguf_arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture '{gguf_arch}' in {path}; loraplex supports {', '.join(ARCHITECTURES)}"
        )
    names = _hf_names(path, gguf_arch, tensors)
    config = _hf_config(path, gguf_arch, metadata, {t.name: t for t in tensors})
    eos = [metadata[key] for key in END_TOKEN_KEYS if key in metadata]
    return GGUFModel(
        path=path,
        gguf_architecture=gguf_arch,
        config=config,
        arch=ModelArch.from_hf_config(SimpleNamespace(**config), str(path)),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        chat_template=metadata.get("tokenizer.chat_template"),
        tensor_names=names,
        _tensors=tensors,
    )


@functools.lru_cache(maxsize=2)
def _parse(path: str, mtime_ns: int, size: int) -> tuple[dict[str, Any], tuple[ReaderTensor, ...]]:
    """(scalar and string metadata, tensors) of a file, parsed once per version of it (`GGUFReader` is slow on a
    large vocabulary; the vocabulary arrays are not kept: the tokenizer converter reads them itself)."""
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
        raise GGUFError(f"cannot read GGUF file {path} (truncated, corrupt or not a GGUF file?): {e}") from e
    metadata = {
        key: value.contents()
        for key, value in reader.fields.items()
        if value.types and value.types[0] != GGUFValueType.ARRAY
    }
    return metadata, tuple(reader.tensors)


def _hf_names(path: Path, gguf_arch: str, tensors: tuple[ReaderTensor, ...]) -> dict[str, str]:
    block_names = {**BLOCK_NAMES, **ARCH_BLOCK_NAMES[gguf_arch]}
    names = {}
    for tensor in tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"tensor '{tensor.name}' in {path} has type {tensor.tensor_type.name}, which loraplex cannot "
                f"dequantize; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}"
            )
        if tensor.name in TOP_NAMES:
            names[tensor.name] = TOP_NAMES[tensor.name]
            continue
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", tensor.name)
        if match is None or match[2] not in block_names:
            hint = " (llama3-style rope frequency factors)" if tensor.name == "rope_freqs.weight" else ""
            raise UnsupportedModelError(
                f"tensor '{tensor.name}'{hint} in {path} is not supported for GGUF architecture '{gguf_arch}'"
            )
        names[tensor.name] = f"model.layers.{match[1]}.{block_names[match[2]]}"
    return names


def _hf_config(path: Path, gguf_arch: str, metadata: dict[str, Any], tensors: dict[str, ReaderTensor]) -> dict:
    """The config.json a Hugging Face checkpoint of this model would have (the keys our ModelArch reads)."""

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise GGUFError(f"{path} lacks the metadata key {gguf_arch}.{key}")
        return value

    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path} has no token_embd.weight tensor")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", get("rope.dimension_count", hidden // heads))
    if get("rope.dimension_count", head_dim) != head_dim:
        raise UnsupportedModelError(f"{path}: partial rotary embeddings (rope over fewer dims than head_dim)")
    config = {
        "architectures": [ARCHITECTURES[gguf_arch]],
        "model_type": gguf_arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # ne order: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    scaling = metadata.get(f"{gguf_arch}.rope.scaling.type", "none")
    if scaling != "none":
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        if f"tokenizer.ggml.{key}" in metadata:
            config[f"{name}_token_id"] = metadata[f"tokenizer.ggml.{key}"]
    return config


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """fp32 in Hugging Face's shape: GGUF lists dims fastest first (ne), so a [576, 49152] is a [49152, 576]."""
    values = dequantize(tensor.data, tensor.tensor_type)  # np.float32, a read-only view of the file for F32
    shape = tuple(int(n) for n in reversed(tensor.shape))
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable).reshape(shape)
    return torch.from_numpy(values)
