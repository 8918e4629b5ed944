"""Tiny random Hugging Face models (built with transformers, saved with save_pretrained) for the tests."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,  # wide logits: greedy choices are far from ties
    bos_token_id=1,
    eos_token_id=2,
)


def make_model(
    directory: Path, tokenizer: PreTrainedTokenizerFast, arch: str = "llama", seed: int = 0, **overrides
) -> torch.nn.Module:
    """Saves a random model of `arch` (and the tokenizer) into `directory`; returns the HF model (fp32, eval)."""
    config_cls, model_cls = ARCHS[arch]
    options = {**TINY, "vocab_size": len(tokenizer), **overrides}
    if arch == "qwen3":
        options.setdefault("head_dim", 16)
    if arch == "mistral":
        options.setdefault("sliding_window", None)
    config = config_cls(**options)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def make_adapter(
    hf_model,
    directory,
    seed: int = 0,
    r: int = 8,
    targets="all-linear",
    config: LoraConfig | None = None,
    safe_serialization: bool = True,
) -> str:
    """A random PEFT LoRA (B != 0) on `hf_model`, saved to `directory` by peft: rank `r`, alpha 2r on `targets`,
    or as `config` says (its init_lora_weights set to False); safe_serialization=False writes adapter_model.bin."""
    config = copy.deepcopy(config) if config is not None else LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets)
    config.init_lora_weights = False
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    peft_model.save_pretrained(str(directory), safe_serialization=safe_serialization)
    return str(directory)


def base_with_adapters(directory: Path, tokenizer: PreTrainedTokenizerFast, count: int = 2, r: int = 8):
    """A random tiny Llama in directory/base and `count` random adapters a0, a1, ... of rank `r` beside it;
    returns (base path, their LoRARequests)."""
    from adapters.ref import LoRARequest

    hf = make_model(directory / "base", tokenizer, "llama")
    loras = [LoRARequest(f"a{i}", make_adapter(hf, directory / f"a{i}", seed=i, r=r)) for i in range(count)]
    return directory / "base", loras
