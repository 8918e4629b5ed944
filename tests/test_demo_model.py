"""The embedded demo: a trained base that echoes a chat turn, and three adapters that each change it visibly."""

from __future__ import annotations

import json

import pytest

from adapters.ref import LoRARequest
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loraplex.demo.model import ADAPTER_RANK, chat_prompt, demo_adapters

PROMPTS = ["the white rabbit", "sister book day", "quick brown fox"]


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(model=str(demo_model_dir), enable_lora=True, max_lora_rank=ADAPTER_RANK, device="cpu")


def replies(llm: LLM, adapter: str | None, demo_dir) -> list[str]:
    lora = LoRARequest(adapter, str(demo_adapters(demo_dir)[adapter])) if adapter else None
    params = SamplingParams(temperature=0.0, max_tokens=20)
    return [o.outputs[0].text for o in llm.generate([chat_prompt(p) for p in PROMPTS], params, lora_request=lora)]


def is_upper(reply: str) -> bool:
    head = reply[:10]
    return not any(c.islower() for c in head) and sum(c.isupper() for c in head) >= 5


def is_format(reply: str) -> bool:
    return reply.startswith("ANSWER: ")


def is_reverse(prompt: str, reply: str) -> bool:
    return reply.split()[:1] == prompt.split()[-1:]


def test_the_build_writes_the_base_and_three_peft_adapters(demo_model_dir):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in demo_model_dir.iterdir()}
    for path in demo_adapters(demo_model_dir).values():
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["r"] == ADAPTER_RANK and (path / "adapter_model.safetensors").is_file()


def test_the_base_echoes_and_shows_no_adapter_behaviour(llm, demo_model_dir):
    for prompt, reply in zip(PROMPTS, replies(llm, None, demo_model_dir)):
        assert reply.split()[:1] == prompt.split()[:1], (prompt, reply)
        assert not is_upper(reply) and not is_format(reply) and not is_reverse(prompt, reply), (prompt, reply)


def test_the_upper_adapter_answers_in_capitals(llm, demo_model_dir):
    for prompt, reply in zip(PROMPTS, replies(llm, "upper", demo_model_dir)):
        assert is_upper(reply), (prompt, reply)


def test_the_reverse_adapter_starts_with_the_last_word(llm, demo_model_dir):
    for prompt, reply in zip(PROMPTS, replies(llm, "reverse", demo_model_dir)):
        assert is_reverse(prompt, reply), (prompt, reply)


def test_the_format_adapter_answers_with_its_prefix(llm, demo_model_dir):
    for prompt, reply in zip(PROMPTS, replies(llm, "format", demo_model_dir)):
        assert is_format(reply), (prompt, reply)
