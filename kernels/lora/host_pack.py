"""HostPack: a step's small index arrays moved to the device in one host-to-device copy.

A step's metadata is a handful of short integer arrays built on the host. Copied one by one, each costs a
pageable-memory copy (~10-20 µs of host time on a GPU host, and a stall of the stream's queue); packed into one
page-locked buffer they cost one asynchronous copy, and the device tensors are views into its device twin. On a
CPU nothing is copied: the views are the host buffer's.
"""

from __future__ import annotations

import numpy as np
import torch

# bytes: where each array starts. Triton specializes a kernel on whether each pointer is a multiple of 16: arrays at
# shifting 8-byte offsets would compile new variants from step to step.
ALIGN = 16
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.bool_): torch.bool}


class HostPack:
    def __init__(self, arrays: dict[str, np.ndarray]):
        """`arrays`: name -> a numpy array of int64, int32 or bool, any shape."""
        self.arrays = arrays
        self.offsets: dict[str, int] = {}
        size = 0
        for name, array in arrays.items():
            self.offsets[name] = size
            size += -(-array.nbytes // ALIGN) * ALIGN
        self.nbytes = size

    def to(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """name -> a tensor on `device` with the array's dtype, shape and values, all from one copy."""
        device = torch.device(device)
        pin = device.type == "cuda"
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)  # [bytes]
        host_bytes = host.numpy()
        for name, array in self.arrays.items():
            start = self.offsets[name]
            host_bytes[start : start + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        packed = host.to(device, non_blocking=True) if device.type != "cpu" else host  # [bytes]
        return {name: self._view(packed, name) for name in self.arrays}

    def _view(self, packed: torch.Tensor, name: str) -> torch.Tensor:
        array, start = self.arrays[name], self.offsets[name]
        return packed[start : start + array.nbytes].view(TORCH_DTYPES[array.dtype]).view(array.shape)
