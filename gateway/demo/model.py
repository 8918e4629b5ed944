"""Builds the embedded demo model: a small Llama with the demo tokenizer, made locally (no download)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from gateway.demo.tokenizer import save_tokenizer

logger = logging.getLogger(__name__)

DEMO_VERSION = "1"


def demo_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "loraplex" / f"demo-v{DEMO_VERSION}"


def build_demo_model(directory: Path | None = None, seed: int = 0) -> Path:
    """Writes config.json, model.safetensors and the tokenizer once; later calls reuse them."""
    from transformers import LlamaConfig, LlamaForCausalLM  # build-time only, never for serving

    directory = directory or demo_dir()
    if (directory / "model.safetensors").is_file():
        return directory
    logger.info("building the demo model in %s", directory)
    tmp = directory.with_name(directory.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(tmp, vocab_size=512)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(tmp)
    tmp.rename(directory)
    return directory
