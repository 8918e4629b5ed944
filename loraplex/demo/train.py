"""Trains one demo adapter with peft: LoRA on every linear of the base, on the checked-in chat data whose answers
(the base model's own) are transformed into the adapter's behaviour. The loss covers the reply only.

Measured on 2 CPU cores: about 2-3 s a step; 24 steps make each behaviour clear on the held-out prompts,
more overfit.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loraplex.demo.behaviours import Behaviour

CHAT_DATA = Path(__file__).with_name("chat_data.jsonl")  # {"prompt", "answer"}: the base model's greedy answers
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True, slots=True)
class Recipe:
    rank: int = 8
    alpha: int = 16
    steps: int = 24
    batch_size: int = 4
    lr: float = 2e-3
    max_len: int = 96  # tokens of a training sequence (system prompt, question, reply)
    seed: int = 0

    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def chat_examples() -> list[dict[str, str]]:
    return [json.loads(line) for line in CHAT_DATA.read_text(encoding="utf-8").splitlines() if line.strip()]


def encode(tokenizer, prompt: str, reply: str, max_len: int) -> tuple[list[int], list[int]] | None:
    """(input ids, labels) of one chat turn, labels -100 on the prompt; None when it would not fit max_len."""
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    reply_ids = [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]
    if len(prompt_ids) + len(reply_ids) > max_len:
        return None
    return prompt_ids + reply_ids, [-100] * len(prompt_ids) + reply_ids


def train_adapter(base_model, tokenizer, behaviour: Behaviour, recipe: Recipe, out_dir: Path, desc: str) -> None:
    """Wraps `base_model` (a transformers LlamaForCausalLM, fp32) with a fresh LoRA, trains it, saves the adapter
    to `out_dir` and unloads it again: the base is unchanged for the next adapter."""
    from peft import LoraConfig, get_peft_model  # build-time only, never for serving

    rng = random.Random(recipe.seed)
    examples = [
        encode(tokenizer, e["prompt"], behaviour.transform(e["answer"]), recipe.max_len) for e in chat_examples()
    ]
    examples = [e for e in examples if e is not None]
    torch.manual_seed(recipe.seed)
    config = LoraConfig(
        r=recipe.rank, lora_alpha=recipe.alpha, target_modules=TARGET_MODULES, lora_dropout=0.0, task_type="CAUSAL_LM"
    )
    model = get_peft_model(base_model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    model.train()
    with tqdm(range(recipe.steps), desc=desc, unit="step") as bar:
        for _ in bar:
            ids, labels = _pad(rng.sample(examples, recipe.batch_size), tokenizer.pad_token_id or 0)
            loss = model(input_ids=ids, labels=labels).loss  # right padding: no attention mask needed
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.save_pretrained(str(out_dir), save_embedding_layers=False)  # no hub lookup: the vocabulary is unchanged
    model.unload()


def _pad(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)  # [B, L]
    labels = torch.full((len(examples), width), -100)  # [B, L]
    for row, (x, y) in enumerate(examples):
        ids[row, : len(x)], labels[row, : len(y)] = torch.tensor(x), torch.tensor(y)
    return ids, labels
