"""LoRALinear: a base linear plus the batched LoRA delta of each token's adapter.

    y = base(x);  y[t, slice_s] += (x[t] @ A_i[s].T) @ B_i[s].T,  i = token_adapter_idx[t]   (-1: base only)

The stacked weights are views into the AdapterCache's rows (each adapter's scaling already folded into B); the
step's LoraMeta comes with each call. A step without adapters (lora None) costs nothing beyond the base.

While a CUDA graph is being recorded (DecodeGraphs), the shrink goes on a side stream, beside the base GEMM: both
only read x, so the graph runs them as parallel branches and the expand waits for both. A decode step's shrink is a
few microseconds of latency on few multiprocessors, which the GEMM beside it hides. Eagerly, the two streams'
events would cost the host more than they save, so a plain call runs them one after the other (or, for a small layer
on the Triton backend, in one launch: `fused_pays`). A graph keeps the two kernels: H200, W1's decode steps took
0.141 s a run with the shrink beside the GEMM and 0.147 with one fused kernel after it (6.7 µs a call against 3.2 for
the shrink and 3.1 for the expand), while its eager prefill step's LoRA cost 0.0037 s fused and 0.0062 in two.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from kernels.lora import LoraMeta, get_lora_ops

# How a CUDA graph records a layer's LoRA: "branched" (the shrink on a side stream beside the base GEMM, then the
# expand), "serial" (the GEMM, the shrink, the expand on one stream) or "plain" (as an eager call: one launch where
# the backend fuses the layer). `bench gpu --graph-variants` times the three.
GRAPH_LORA = "branched"


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        output_slices: tuple[int, ...],
        backend: str = "torch",
    ):
        super().__init__()
        self.base = base
        self.lora_a = lora_a  # [N, S * R, H_in]
        self.lora_b = lora_b  # [N, H_out, R]
        self.output_slices = output_slices
        self.ops = get_lora_ops(backend)

    def forward(self, x: torch.Tensor, lora: LoraMeta | None = None) -> torch.Tensor:
        capturing = lora is not None and x.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing and GRAPH_LORA == "branched":
            return self._forward_branched(x, lora)
        y = self.base(x)  # [T, H_out]
        if lora is not None:
            # "serial" graphs: two kernels on one stream (a buffer given: never fused)
            buffer = self.ops.shrink_out(x, self.lora_a, lora) if capturing and GRAPH_LORA == "serial" else None
            self.ops.add_lora(y, x, self.lora_a, self.lora_b, lora, self.output_slices, buffer)
        return y

    def _forward_branched(self, x: torch.Tensor, lora: LoraMeta) -> torch.Tensor:
        """The shrink on the side stream while the base GEMM runs on the capturing one; then the expand."""
        main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
        z = self.ops.shrink_out(x, self.lora_a, lora)  # [T, S * R] or [P, T, S * R]: on the main stream, as y is
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            self.ops.lora_shrink(z, x, self.lora_a, lora)
        y = self.base(x)  # [T, H_out]
        main.wait_stream(side)  # z is ready
        self.ops.lora_expand(y, z, self.lora_b, lora, self.output_slices)
        return y


def apply_linear(module: nn.Module, x: torch.Tensor, lora: LoraMeta | None) -> torch.Tensor:
    """module(x) for a LoRA-able projection: with the step's LoRA deltas once the runner has wrapped it in a
    LoRALinear, else the plain (nn.Linear or PackedLinear) base."""
    return module(x, lora) if isinstance(module, LoRALinear) else module(x)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
