"""The peer comparison's workload file: one JSON that loraplex's and vLLM's drivers both read.

    {"model": DIR, "adapters": [[name, path], ...], "output_len": 64, "max_model_len": ..., "max_num_seqs": ...,
     "max_lora_rank": 8, "max_loras": 8, "max_cpu_loras": 8, "dtype": "float32", "regex": null,
     "warmup": [[ids, adapter_index], ...], "runs": [[[ids, adapter_index], ...], ...]}

With "regex" set, every request's output is held to it (structured outputs, both engines) for exactly output_len
tokens: the regex should admit that many (e.g. `[A-Za-z ,.]+`); EOS is banned until then.

Every run has fresh random prompt ids (no run can hit the other's prefix cache) and each request's adapter is
drawn uniformly among the K adapters; the same seed gives the same file.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

FIRST_REGULAR_ID = 4  # below it: the special tokens of bench/tokenizer.py's BPE


@dataclass(frozen=True, slots=True)
class PeerWorkload:
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    runs: int = 3
    seed: int = 0
    max_loras: int | None = None  # adapter rows in each engine (None: one per adapter)
    max_cpu_loras: int | None = None  # adapters in host memory (None: every adapter)
    dtype: str = "float32"  # both engines' (the oracle's precision by default)
    regex: str | None = None  # every output held to it (structured outputs), None: free

    def requests(self, vocab_size: int, num_adapters: int, run: int) -> list[tuple[list[int], int]]:
        """[(prompt ids, adapter index)] of one run; index 0 when there are no adapters."""
        rng = random.Random(self.seed * 1000 + run)
        return [
            (
                [rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(self.input_len)],
                rng.randrange(num_adapters) if num_adapters else 0,
            )
            for _ in range(self.num_prompts)
        ]

    def write(self, path: Path, model: Path, adapters: list[tuple[str, str]], max_lora_rank: int) -> Path:
        vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
        rows = self.max_loras or max(1, len(adapters))
        warmup_rng = random.Random(-1 - self.seed)
        warmup = [  # one short request per adapter: every adapter loaded before the clock starts
            ([warmup_rng.randrange(FIRST_REGULAR_ID, vocab_size) for _ in range(16)], i)
            for i in range(max(1, len(adapters)))
        ]
        body = {
            "model": str(model),
            "adapters": [list(a) for a in adapters],
            "output_len": self.output_len,
            "max_model_len": self.input_len + self.output_len + 16,
            "max_num_seqs": max(self.num_prompts, 1),
            "max_lora_rank": max_lora_rank,
            "max_loras": rows,
            "max_cpu_loras": max(rows, self.max_cpu_loras or len(adapters)),
            "dtype": self.dtype,
            "regex": self.regex,
            "warmup": warmup,
            "runs": [self.requests(vocab_size, len(adapters), run) for run in range(self.runs)],
        }
        path.write_text(json.dumps(body))
        return path
