"""AdapterLayout: what `load_lora`'s checks found in one adapter's weights-file header and adapter_config.json, kept
for the next adapter whose header and config are the same bytes, so that reading it is one pass over its values.

A server with hundreds of adapters from one training recipe reads files that differ only in their values: the same
tensor names, dtypes, shapes and offsets (the safetensors header), the same config. Every check but the values'
(names, shapes against the base model, pairs, ranks, targets, scalings) gives the same answer for the same header
and config on the same base model and max_lora_rank, so once a file has passed them all, its layout is kept here,
keyed by a digest of those bytes, and the next such file skips them: its tensors are views of its values at the
offsets the layout holds. The values are still checked on every read (finite, and their largest magnitude), and a
file whose values fail goes the whole way again, so its error names the tensor. W1's rank-8 adapter on all modules
(112 tensors), one thread, on a Xeon with AMX (family 6 model 167, 2026-12-02): `load_lora` 0.93 ms where the checks
and the safetensors parse made it 2.06, a read into host rows (`AdapterCache.read`) 1.7 ms against 2.9.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from adapters.base_spec import BaseModelSpec
from adapters.locked_lru import LockedLRU

MAX_LAYOUTS = 64  # distinct (header, config) pairs kept, least recently used dropped: one per recipe in practice

LayoutKey = tuple[int, tuple, int, bytes]


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """The checked structure of one weights file and config: where each tensor's values lie, and what the checks
    concluded of them."""

    dtype: torch.dtype  # every stored tensor's
    payload_start: int  # bytes into the file where the values begin
    file_size: int
    names: tuple[str, ...]  # every stored tensor's name (`<module key>.lora_A|B`, as load_lora names it), in file order
    sizes: tuple[int, ...]  # their elements, one after another from payload_start
    shapes: tuple[tuple[int, ...], ...]
    # ((layer, module), its module key, the index of its A and of its B in `names`, its scaling), in module order
    modules: tuple[tuple[tuple[int, str], str, int, int, float], ...]

    @property
    def pairs(self) -> dict[tuple[int, str], str]:
        """(layer, module) -> module key, as load_lora's checks paired them."""
        return {module: key for module, key, _, _, _ in self.modules}

    def read(self, data: bytes) -> tuple[dict[str, torch.Tensor], dict, np.ndarray] | None:
        """(name -> stored tensor; (layer, module) -> (A, B as fp32, scaling); the payload as one array), all views
        of `data`, for a file of this layout; None when `data` is not one (its size differs)."""
        if len(data) != self.file_size:
            return None
        stored = torch.frombuffer(data, dtype=self.dtype, count=sum(self.sizes), offset=self.payload_start)  # [payload]
        views = [t.view(shape) for t, shape in zip(stored.split(self.sizes), self.shapes, strict=True)]
        as_fp32 = views if self.dtype == torch.float32 else [t.float() for t in views]
        weights = {module: (as_fp32[a], as_fp32[b], scaling) for module, _, a, b, scaling in self.modules}
        return dict(zip(self.names, views, strict=True)), weights, stored.numpy()


def payload_start(data: bytes) -> int:
    """Where the values of the safetensors file `data` begin: after its 8-byte header length and its header."""
    return 8 + int.from_bytes(data[:8], "little")


def layout_key(spec: BaseModelSpec, max_lora_rank: int, config_bytes: bytes, data: bytes) -> LayoutKey | None:
    """The key of the file `data` (a safetensors file, read whole) with its config: the base model's shape, the rank
    limit and a digest of the config and the header; None when `data` has no whole header."""
    if len(data) < 8 or len(data) < (start := payload_start(data)):
        return None
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    digest.update(data[:start])
    shapes = (spec.num_layers, tuple(sorted(spec.module_shapes.items())))
    return (max_lora_rank, shapes, len(config_bytes), digest.digest())


def layout_of(
    data: bytes,
    header: dict,
    renamed: dict[str, str],
    pairs: dict[tuple[int, str], str],
    scalings: dict[tuple[int, str], float],
    dtype: torch.dtype,
) -> AdapterLayout | None:
    """The layout of a file that passed every check: `header` its parsed safetensors header, `renamed` stored name ->
    load_lora's name; None where its values are not one gapless run of `dtype` in offset order (then no layout)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    entries = sorted(((info["data_offsets"], k) for k, info in header.items() if k != "__metadata__"))
    names, sizes, shapes, end = [], [], [], 0
    for (begin, stop), stored_name in entries:
        shape = tuple(header[stored_name]["shape"])
        size = math.prod(shape)
        if begin != end or size * itemsize != stop - begin:
            return None
        names.append(renamed[stored_name])
        sizes.append(size)
        shapes.append(shape)
        end = stop
    if payload_start(data) + end != len(data):
        return None
    index = {name: i for i, name in enumerate(names)}
    modules = tuple(
        (module, key, index[f"{key}.lora_A"], index[f"{key}.lora_B"], scalings[module])
        for module, key in sorted(pairs.items())
    )
    return AdapterLayout(
        dtype=dtype,
        payload_start=len(data) - end,
        file_size=len(data),
        names=tuple(names),
        sizes=tuple(sizes),
        shapes=tuple(shapes),
        modules=modules,
    )


LAYOUTS: LockedLRU[LayoutKey, AdapterLayout] = LockedLRU(MAX_LAYOUTS)
