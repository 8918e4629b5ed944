"""ScreenedGreedyHead: greedy tokens of an fp32 LM head at about half its cost, on CPUs with native bf16 matmuls.

A decode step's LM head is its largest matmul ([B, H] x [H, V], V = 32-49K): 16% of a W1 run in fp32. When every
row of a step only wants its argmax (greedy, no logprobs, no penalties), the head runs in bf16 instead (oneDNN's
prepacked bf16 GEMM, twice fp32's speed with avx512_bf16 or AMX), and kernels/sampling's screen computes in fp32
only the tokens that bf16's error bound leaves in the running: the tokens are those of the fp32 logits' argmax. The
fp32 dense weight it rechecks against is the head's own (tied: the embedding table, shared; else kept beside the
packed fp32 copy), and a bf16 copy is added: 1.5x the head's fp32 bytes on an untied model.
"""

from __future__ import annotations

import torch

from kernels.sampling import UNDECIDED, screened_greedy_tokens


class ScreenedGreedyHead:
    def __init__(self, weight: torch.Tensor):
        """weight: the LM head's [V, H] fp32 weight, before it is packed."""
        self.weight = weight.detach().contiguous()  # [V, H] fp32 (the same storage as a tied embedding's)
        self.row_norms = self.weight.norm(dim=1)  # [V]
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(self.weight.to(torch.bfloat16), 64)

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, H] fp32 -> [B] int64 greedy tokens (-1: the row's logits are not finite); None when the bf16
        screen cannot decide (its logits overflowed) or the kernel is missing: the caller computes full logits."""
        approx = torch.ops.mkldnn._linear_pointwise(hidden.to(torch.bfloat16), self.packed_bf16, None, "none", [], "")
        token_ids = screened_greedy_tokens(approx, hidden.contiguous(), self.weight, self.row_norms)  # [B]
        if token_ids is None or bool((token_ids == UNDECIDED).any()):
            return None
        return token_ids
