"""A small byte-level BPE tokenizer trained here, for models with random weights (the benchmarks' W1-style model
and the tests' tiny models): nothing downloaded, every string round-trips, non-ASCII spans several tokens."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the Llama convention for unk / bos / eos
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
TEXT_BYTES = 2 << 20  # of Python's own standard library: English docstrings and code


def stdlib_text(budget: int = TEXT_BYTES) -> list[str]:
    """The first `budget` bytes of the standard library's modules, in a fixed order (the same on every machine
    with the same Python)."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= budget:
            break
    return texts


def train_tokenizer(vocab_size: int = 512, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts if texts is not None else stdlib_text(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(directory: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Trains (on enough text for `vocab_size` tokens: every id of the model then decodes to some text, so a
    stream's first token is visible) and saves the tokenizer files into `directory`."""
    tokenizer = train_tokenizer(vocab_size, stdlib_text(max(TEXT_BYTES, vocab_size * 256)))
    tokenizer.save_pretrained(str(directory))
    return tokenizer
