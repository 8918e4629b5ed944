"""A stand-in for vllm, for the unit test of bench/vllm_driver.py only (vLLM itself is never installed here): it
records what the driver asked for in $FAKE_VLLM_LOG and "generates" max_tokens zeros per prompt."""

import json
import os

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Completion:
    def __init__(self, n):
        self.token_ids = [0] * n


class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]


class LLM:
    def __init__(self, **options):
        self._log("init", options)

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        ids = [p["prompt_token_ids"] for p in prompts]
        adapters = [r.lora_name for r in lora_request] if lora_request else None
        self._log("generate", {"prompts": ids, "adapters": adapters, "params": params.kwargs})
        return [_Output(params.kwargs["max_tokens"]) for _ in prompts]

    @staticmethod
    def _log(event, body):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
            f.write(json.dumps({"event": event, "body": body, "env_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}))
            f.write("\n")
