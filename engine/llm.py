"""LLM: the offline API, `LLM(model=DIR).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from adapters.ref import LoRARequest
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

IDLE_POLL_S = 0.002
Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}


class LLM:
    def __init__(self, model: str, **config: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def to_request(
        self, prompt: Prompt, params: SamplingParams, lora: LoRARequest | None = None, tenant: str | None = None
    ) -> EngineRequest:
        text = None
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            prompt = prompt.get("prompt_token_ids", text)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        return EngineRequest(str(next(self._ids)), token_ids, params, lora=lora, tenant=tenant, prompt=text)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tenant: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuous batch; outputs come back in prompt order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt; `tenant` likewise (it matters
        under scheduling_policy="fair"). The adapters of the first max_loras requests to need one are read first, and
        one that does not load raises AdapterError before any prompt runs. A request that failed alone (an adapter
        read later could not load, its numbers went non-finite) comes back with `error` set."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        loras = lora_request if isinstance(lora_request, list | tuple) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} lora requests")
        tenants = tenant if isinstance(tenant, list | tuple) else [tenant] * len(prompts)
        if len(tenants) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(tenants)} tenants")
        requests = [self.to_request(*args) for args in zip(prompts, params, loras, tenants)]
        for request in requests:  # validate all, adapters included, before queueing any
            self.engine.validate(request)
        # the adapters the first rows take are read now (a bad one raises before anything is queued); the others
        # load in the background as their turn nears (reading them all here would push the first ones out of host
        # memory when there are more than it holds), and one that fails then ends its own requests with the error
        first_needed = list(dict.fromkeys(r.lora for r in requests if r.lora is not None))
        for lora in first_needed[: self.engine.config.max_loras]:
            self.engine.add_adapter(lora)
        for request in requests:
            self.engine.add_request(request)
        results = {r.request_id: self._empty_output(r) for r in requests}
        with tqdm(total=len(requests), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                deltas = self.engine.step()
                if not self.engine.last_step_ran:
                    time.sleep(IDLE_POLL_S)  # only adapters loading in the background: let the loader run
                for delta in deltas:
                    _accumulate(results[delta.request_id], delta)
                    bar.update(delta.finished)
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`generate` over conversations (lists of {"role", "content"}), each rendered with the tokenizer's chat
        template and ready for the assistant's reply, as vLLM's `LLM.chat`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.tokenizer.chat_template is None:
            raise ValueError("the model's tokenizer has no chat template; use generate() with plain prompts")
        prompts = [
            {"prompt_token_ids": self.tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False)}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    @staticmethod
    def _empty_output(request: EngineRequest) -> RequestOutput:
        outputs = [
            CompletionOutput(i, "", [], [] if request.sampling.logprobs is not None else None)
            for i in range(request.sampling.n)
        ]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs)


def _accumulate(result: RequestOutput, delta: RequestOutput) -> None:
    for d in delta.outputs:
        out = result.outputs[d.index]
        out.text += d.text
        out.token_ids.extend(d.token_ids)
        if out.logprobs is not None and d.logprobs:
            out.logprobs.extend(d.logprobs)
        out.finish_reason, out.stop_reason = d.finish_reason, d.stop_reason
    result.finished = delta.finished
    result.num_cached_tokens = delta.num_cached_tokens
    result.metrics, result.adapter_tier = delta.metrics, delta.adapter_tier
    if delta.prompt_logprobs is not None:
        result.prompt_logprobs = delta.prompt_logprobs
    result.error = delta.error if delta.error is not None else result.error  # failed alone: the batch went on
