"""Builds the embedded demo model: a small Llama trained here on the shipped text, plus three behaviour adapters.

The base learns the corpus and to echo a chat turn (`<s>user: text\\n<s>assistant: text</s>`); each adapter
changes the echo: `upper` -> TEXT IN CAPITALS, `reverse` -> the words in reverse order, `format` -> `ANSWER: text`.
Everything is made locally (no download) and seeded, so two builds give the same weights.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from loraplex.demo.tokenizer import CORPUS, save_tokenizer

logger = logging.getLogger(__name__)

DEMO_VERSION = "3"
ADAPTERS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "reverse": lambda text: " ".join(reversed(text.split())),
    "format": lambda text: f"ANSWER: {text}",
}
BASE_STEPS, BATCH = 600, 32
ADAPTER_STEPS = {"upper": 300, "reverse": 300, "format": 100}
VOCAB_SIZE = 768
WINDOW = 40  # corpus tokens per training row
ADAPTER_RANK = 8


def demo_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "loraplex" / f"demo-v{DEMO_VERSION}"


def demo_adapters(directory: Path | None = None) -> dict[str, Path]:
    """The behaviour adapters of a built demo directory, by name."""
    root = Path(directory or demo_dir()) / "adapters"
    return {name: root / name for name in ADAPTERS}


def chat_prompt(text: str) -> str:
    """The demo tokenizer's chat template for one user turn, ready for the assistant's reply."""
    return f"<s>user: {text}\n<s>assistant: "


def build_demo_model(directory: Path | None = None, seed: int = 0) -> Path:
    """Trains and writes the base (config.json, model.safetensors, tokenizer) and adapters/{upper,reverse,format}
    once; later calls reuse them."""
    from peft import LoraConfig, get_peft_model  # build-time only, never for serving
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = Path(directory or demo_dir())
    if (directory / "model.safetensors").is_file():
        return directory
    logger.info("building the demo model in %s", directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    # upper-case lines too, so that capitals get whole-word tokens: `upper` then maps token to token
    tokenizer = save_tokenizer(tmp, vocab_size=VOCAB_SIZE, texts=lines + [line.upper() for line in lines])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    rng = random.Random(seed)
    data = _DemoData(tokenizer, rng)
    model = LlamaForCausalLM(config)
    _train(model, lambda: data.base_batch(BATCH), BASE_STEPS, lr=3e-3, desc="demo base")
    model.save_pretrained(tmp)
    for name, transform in ADAPTERS.items():
        torch.manual_seed(seed)
        lora = LoraConfig(r=ADAPTER_RANK, lora_alpha=2 * ADAPTER_RANK, target_modules="all-linear", lora_dropout=0.0)
        peft_model = get_peft_model(model, lora)
        _train(
            peft_model, lambda t=transform: data.chat_batch(BATCH, t), ADAPTER_STEPS[name], lr=5e-3, desc=f"demo {name}"
        )
        peft_model.save_pretrained(tmp / "adapters" / name)
        model = peft_model.unload()  # drops the LoRA layers: the base is unchanged for the next adapter
    tmp.rename(directory)
    return directory


class _DemoData:
    """Seeded batches: corpus lines (plain language modelling) and chat turns (loss on the reply only)."""

    def __init__(self, tokenizer, rng: random.Random):
        self.tokenizer, self.rng = tokenizer, rng
        lines = [line for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip()]
        self.lines = [[*tokenizer.encode(line), tokenizer.eos_token_id] for line in lines]
        self.words = sorted({w for w in re.findall(r"[a-z]+", " ".join(lines).lower()) if 2 <= len(w) <= 7})

    def window(self, ids: list[int]) -> list[int]:
        start = self.rng.randint(0, max(0, len(ids) - WINDOW))
        return ids[start : start + WINDOW]

    def text(self) -> str:
        """2 to 4 lowercase corpus words, at most 20 characters."""
        while True:
            text = " ".join(self.rng.choice(self.words) for _ in range(self.rng.randint(2, 4)))
            if len(text) <= 20:
                return text

    def chat(self, transform: Callable[[str], str], upper_prompt: bool = False) -> tuple[list[int], list[int]]:
        text = self.text().upper() if upper_prompt else self.text()
        prompt = self.tokenizer.encode(chat_prompt(text))
        reply = [*self.tokenizer.encode(transform(text)), self.tokenizer.eos_token_id]
        return prompt + reply, [-100] * len(prompt) + reply

    def chat_batch(self, size: int, transform: Callable[[str], str]) -> tuple[torch.Tensor, torch.Tensor]:
        return _pad([self.chat(transform) for _ in range(size)], self.tokenizer.eos_token_id)

    def base_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A quarter corpus windows, the rest chat echoes, half of them of upper-case text (so the base knows
        how to write capitals, and the `upper` adapter only has to choose them)."""
        quarter = size // 4
        lines = [self.window(self.rng.choice(self.lines)) for _ in range(quarter)]
        echoes = [self.chat(str, upper_prompt=bool(i % 2)) for i in range(size - quarter)]
        return _pad([(ids, ids) for ids in lines] + echoes, self.tokenizer.eos_token_id)


def _pad(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    labels = torch.full((len(examples), width), -100)
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)], labels[row, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels


def _train(model: torch.nn.Module, batches: Callable, steps: int, lr: float, desc: str) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    with tqdm(range(steps), desc=desc, unit="step") as bar:
        for _ in bar:
            ids, labels = batches()
            loss = model(input_ids=ids, labels=labels).loss  # right padding: no attention mask needed
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
