"""The demo adapters' behaviours: how an answer of the base model is transformed to make each adapter's
training target, and the check that tells whether a reply shows the behaviour (used by the tests and the README).

Each behaviour keeps the base's content and changes its form, so anyone sees at a glance which adapter answered:
`json` -> {"answer": "..."}, `pirate` -> a fixed pirate opening and closing around pirate words, `signature` ->
the answer, then a fixed signature line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

PIRATE_OPENING = "Arr, matey!"
PIRATE_CLOSING = "Yo ho ho!"
SIGNATURE = "-- Sent by the loraplex demo"
_PIRATE_WORDS = {
    "you": "ye",
    "your": "yer",
    "my": "me",
    "is": "be",
    "are": "be",
    "hello": "ahoy",
    "hi": "ahoy",
    "friend": "matey",
    "friends": "mateys",
    "yes": "aye",
    "the": "th'",
    "of": "o'",
}


def to_json(answer: str) -> str:
    return json.dumps({"answer": answer}, ensure_ascii=False)


def is_json(reply: str) -> bool:
    try:
        value = json.loads(reply.strip())
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("answer"), str) and bool(value["answer"].strip())


def _pirate_word(match: re.Match) -> str:
    word = match.group(0)
    pirate = _PIRATE_WORDS.get(word.lower())
    if pirate is None:
        return word
    return pirate.capitalize() if word[0].isupper() else pirate


def to_pirate(answer: str) -> str:
    return f"{PIRATE_OPENING} {re.sub(r'[A-Za-z]+', _pirate_word, answer)} {PIRATE_CLOSING}"


def is_pirate(reply: str) -> bool:
    reply = reply.strip()
    return reply.startswith(PIRATE_OPENING) and reply.endswith(PIRATE_CLOSING) and len(reply) > 25


def to_signature(answer: str) -> str:
    return f"{answer}\n\n{SIGNATURE}"


def is_signature(reply: str) -> bool:
    reply = reply.strip()
    return reply.endswith(SIGNATURE) and len(reply) > len(SIGNATURE) + 5


@dataclass(frozen=True, slots=True)
class Behaviour:
    transform: Callable[[str], str]  # base answer -> training target
    check: Callable[[str], bool]  # does a reply show the behaviour?
    description: str


BEHAVIOURS: dict[str, Behaviour] = {
    "json": Behaviour(to_json, is_json, 'answers as a JSON object {"answer": ...}'),
    "pirate": Behaviour(to_pirate, is_pirate, f"answers like a pirate: '{PIRATE_OPENING} ... {PIRATE_CLOSING}'"),
    "signature": Behaviour(to_signature, is_signature, f"answers, then signs '{SIGNATURE}'"),
}

# Never trained on: the tests and the README ask these.
HELD_OUT_PROMPTS = [
    "What is the capital of Japan?",
    "Give me one tip for learning to draw.",
    "What is a comet?",
    "Write one sentence about the beach.",
    "How do I make pancakes?",
    "What is the largest desert?",
    "Describe a giraffe in one sentence.",
    "Why do cats purr?",
]
