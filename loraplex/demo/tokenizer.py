"""Trains the small byte-level BPE tokenizer of the embedded demo (and of the tests) from text shipped here."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = Path(__file__).with_name("corpus.txt")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the Llama convention for unk / bos / eos
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def train_tokenizer(vocab_size: int = 512, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: every string round-trips, and non-ASCII characters span several tokens."""
    texts = texts if texts is not None else CORPUS.read_text(encoding="utf-8").splitlines()
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(
    directory: str | Path, vocab_size: int = 512, texts: list[str] | None = None
) -> PreTrainedTokenizerFast:
    tokenizer = train_tokenizer(vocab_size, texts)
    tokenizer.save_pretrained(str(directory))
    return tokenizer
