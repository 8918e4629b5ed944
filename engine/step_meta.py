"""StepMeta: everything a forward pass reads about its step besides the tokens, built once by the model runner.

`model(input_ids, positions, meta)` hands it down: attention reads `meta.attn`, the LoRA-able projections
`meta.lora` (None: no token of the step has an adapter, and the projections run their base linear only).
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels.lora import LoraMeta
from kernels.paged_attention import PagedAttentionMeta


@dataclass(frozen=True, slots=True)
class StepMeta:
    attn: PagedAttentionMeta
    lora: LoraMeta | None = None
