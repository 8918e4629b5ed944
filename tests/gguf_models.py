"""Writes a Hugging Face model and its tokenizer as a GGUF file, the way llama.cpp's converter does, for the tests.

Names and the Q/K row permutation follow llama.cpp's `convert_hf_to_gguf.py`, written out here on their own, so
that a mistake in `engine.gguf_reader` cannot cancel out against the same mistake in the writer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from transformers import PreTrainedTokenizerFast

HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP:
        return TOP[hf_name]
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def permute(weight: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rotate-half rows [2, D/2] become interleaved pairs [D/2, 2]."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = weight.shape
    return weight.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, for the types gguf cannot quantize (K-quants): [rows, bytes].

    Every bit pattern is a valid block but for the fp16 scales, which are set so that |weight| stays below ~0.2."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    scale_offsets, largest = {  # byte offsets of the fp16 scales in a block (ggml-common.h), largest scale
        GGMLQuantizationType.Q2_K: ((80, 82), 4e-3),  # d * 4-bit scale * 2-bit q, dmin * 4-bit min
        GGMLQuantizationType.Q3_K: ((108,), 1.5e-3),  # d * 6-bit signed scale * 3-bit signed q
        GGMLQuantizationType.Q4_K: ((0, 2), 2e-4),  # d * 6-bit scale * 4-bit q, dmin * 6-bit min
        GGMLQuantizationType.Q5_K: ((0, 2), 1e-4),
        GGMLQuantizationType.Q6_K: ((208,), 5e-5),  # d * int8 scale * 6-bit signed q
    }[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)  # [rows, blocks, bytes]
    for offset in scale_offsets:
        scales = rng.uniform(largest / 10, largest, (rows, cols // block)).astype(np.float16)
        data[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


def add_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    """A byte-level BPE tokenizer in GGUF form (tokenizer.ggml.model "gpt2"), with its chat template."""
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(
    path: Path,
    hf_model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    arch: str = "llama",
    seed: int = 0,
    raw: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """Writes `hf_model` (fp32) as `path`: matrices in `qtype`, norms and biases in F32 (as llama.cpp keeps them).

    For the K-quants, which gguf cannot quantize, the matrices are random blocks instead of the model's weights.
    `raw` replaces tensors (by GGUF name) with given bytes of a given type: [rows, bytes per row] uint8.
    """
    raw = raw or {}
    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, tokenizer)
    k_quant = qtype.name.endswith("_K")
    for index, (name, tensor) in enumerate(hf_model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if gguf_name(name) in raw:
            data, raw_type = raw[gguf_name(name)]
            writer.add_tensor(gguf_name(name), data, raw_dtype=raw_type)
            continue
        weight = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            weight = permute(weight, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = permute(weight, config.num_attention_heads, config.num_key_value_heads)
        if weight.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(weight, dtype=np.float32))
        elif k_quant:
            writer.add_tensor(gguf_name(name), random_blocks(qtype, *weight.shape, seed + index), raw_dtype=qtype)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), weight.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), quantize(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
