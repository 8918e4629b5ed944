"""An adapter's content digest ("sha256:<hex>"), and the cache that spares hashing the same weights file twice.

The digest is sha256 over each tensor's name, dtype, shape and bytes in name order, then each module's scaling: two
adapters with the same tensors but another lora_alpha compute different things, so they differ here too. It names
the adapter's content everywhere (the prefix cache's keys, the registry, the replicas' file cache).

Hashing is the largest part of reading an adapter (1.2 of 3.2 ms of CPU for rank 8 on all modules of a 56M Llama,
2.4 MB, AMD Zen 5), and a server with more adapters than host memory holds reads the same files again and again,
beside the running engine. So the tensors' part of the hash is kept per weights file, keyed by what `fstat` says of
the file (device, inode, size, modification and change times, the same before and after the read, as git's index
keys a file's hash): any write to the file changes its change time, which no one but the kernel sets. A file
changed less than RACY_S ago is not kept, so a write within one tick of the file system's clock cannot hide.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any, NamedTuple

import torch

from adapters.locked_lru import LockedLRU

MAX_FILES = 4096  # weights files whose hash state is kept (about 300 bytes each), least recently used dropped
RACY_S = 2.0  # a file changed this recently is hashed every time


class FileIdentity(NamedTuple):
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled_identity(before: os.stat_result, after: os.stat_result) -> FileIdentity | None:
    """The identity of a file read between two `fstat`s, or None when it changed meanwhile or too recently."""
    identity = FileIdentity.of(before)
    if identity != FileIdentity.of(after) or time.time_ns() - max(identity.mtime_ns, identity.ctime_ns) < RACY_S * 1e9:
        return None
    return identity


# FileIdentity -> the sha256 state after the tensors of that file (copied in and out: a state is changed by use)
TENSOR_HASHES: LockedLRU[FileIdentity, Any] = LockedLRU(MAX_FILES)


def hash_tensors(tensors: dict[str, torch.Tensor]):
    """The sha256 state after each tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy())
    return h


def content_digest(
    tensors: dict[str, torch.Tensor], scalings: dict[str, float], file: FileIdentity | None = None
) -> str:
    """The adapter's digest. `tensors` must be what the weights file `file` (when given) holds, read whole: its
    tensors' hash is then taken from the cache when that file was hashed before, and kept for next time."""
    kept = TENSOR_HASHES.get(file) if file is not None else None
    if kept is not None:
        state = kept.copy()
    else:
        state = hash_tensors(tensors)
        if file is not None:
            TENSOR_HASHES.put(file, state.copy())
    for key in sorted(scalings):
        state.update(f"scaling\0{key}\0{scalings[key]!r}\0".encode())
    return f"sha256:{state.hexdigest()}"
