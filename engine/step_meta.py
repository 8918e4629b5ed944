"""StepMeta: everything a forward pass reads about its step besides the tokens, built once by the model runner.

`model(input_ids, positions, meta)` hands it down: attention reads `meta.attn`, the LoRA-able projections
`meta.lora` (None: no token of the step has an adapter, and the projections run their base linear only).

`meta.output_rows` (set when a step holds prefill tokens) names the rows whose final hidden states the step uses,
each sequence's last token: the last layer then computes its K/V for every token, as the cache needs them, but its
attention, o_proj and MLP only for those rows, and the model returns [B, H] instead of [T, H]. No later layer reads
the other rows' outputs, so nothing is lost: a prefill's last layer shrinks from T rows to one per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kernels.lora import LoraMeta
from kernels.paged_attention import PagedAttentionMeta


@dataclass(frozen=True, slots=True)
class OutputRows:
    rows: Tensor  # [B] int64: the flat batch's rows the step's caller reads (each sequence's last token)
    attn: PagedAttentionMeta  # those rows as decode queries over their sequences' whole context, this step's included
    lora: LoraMeta | None  # the LoRA meta of those rows (None: none of them has an adapter)


@dataclass(frozen=True, slots=True)
class StepMeta:
    attn: PagedAttentionMeta
    lora: LoraMeta | None = None
    output_rows: OutputRows | None = None  # None: the model returns every row
