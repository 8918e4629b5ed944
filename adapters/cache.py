"""AdapterCache: the device rows of stacked LoRA weights, the host-memory LRU tier, and the loader thread.

It alone maps an adapter to its `adapter_idx` (a row of every stacked tensor) and keeps pin counts: a pinned
row (once per running request, whatever its number of samples, or by an operator's pin) is never evicted.
Reading and validating an adapter from disk happens on the loader thread (or a caller's worker thread), off the
step's critical path; activating a host-resident adapter is one copy per stacked tensor, done by the engine
thread between steps.

Stacked layout per layer and packed module (e.g. "qkv_proj" = q, k, v slices):
`lora_a: [max_loras, S * R, H_in]`, `lora_b: [max_loras, H_out, R]` with R = max_lora_rank, lower ranks
zero-padded, modules an adapter does not target left zero, and each module's scaling folded into its B. For the CPU
kernels (`transposed_b`) B is stored as `lora_bt: [max_loras, R, H_out]` and `lora_b` is its transposed view.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from adapters.base_spec import BaseModelSpec
from adapters.lora_weights import AdapterError, LoRAWeights, load_lora, magnitudes
from adapters.ref import LoRARequest

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # LoRARequest.key


@dataclass(slots=True)
class HostAdapter:
    weights: LoRAWeights  # what was read, without its per-module tensors: `rows` hold them, packed
    # (layer, packed) -> (A row [S * R, H_in], B row): [H_out, R], or [R, H_out] where the cache keeps B transposed
    rows: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    load_seconds: float


@dataclass(slots=True)
class AdapterCacheStats:
    loads: int = 0
    load_seconds: float = 0.0
    activations: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    failures: int = 0


@dataclass(slots=True)
class _Rows:
    row_of: OrderedDict[Key, int] = field(default_factory=OrderedDict)  # resident, least recently used first
    pins: list[int] = field(default_factory=list)
    free: list[int] = field(default_factory=list)


class AdapterCache:
    def __init__(
        self,
        spec: BaseModelSpec,
        packed: dict[str, tuple[str, ...]],
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        device: torch.device,
        dtype: torch.dtype,
        allow_pickle: bool = False,
        loader_setup: Callable[[], None] | None = None,
        transposed_b: bool = False,
    ):
        """`loader_setup` runs first on the loader thread (the engine keeps it off its OpenMP team).
        `transposed_b`: keep every B stack as [N, R, H_out] (`lora_bt`), with `lora_b` its transposed view, for
        kernels that read B that way (the CPU ones: otherwise they transpose every row of a stack again whenever
        any one row changes); the host rows then hold B transposed too, so an activation is plain row copies."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.spec, self.packed = spec, packed
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = max_loras, max_cpu_loras, max_lora_rank
        self.device, self.dtype, self.allow_pickle = device, dtype, allow_pickle
        rank = max_lora_rank
        self.lora_a: list[dict[str, torch.Tensor]] = []  # per layer: packed name -> [N, S * R, H_in]
        self.lora_b: list[dict[str, torch.Tensor]] = []  # per layer: packed name -> [N, H_out, R]
        # per layer: packed name -> [N, R, H_out], whose transposed view lora_b is (transposed_b only)
        self.lora_bt: list[dict[str, torch.Tensor]] | None = [] if transposed_b else None
        for _ in range(spec.num_layers):
            a, b, bt = {}, {}, {}
            for name, modules in packed.items():
                h_in = spec.module_shapes[modules[0]][0]
                h_out = sum(spec.module_shapes[m][1] for m in modules)
                a[name] = torch.zeros(max_loras, len(modules) * rank, h_in, dtype=dtype, device=device)
                if transposed_b:
                    bt[name] = torch.zeros(max_loras, rank, h_out, dtype=dtype, device=device)
                    b[name] = bt[name].transpose(1, 2)  # one write of a row updates both
                else:
                    b[name] = torch.zeros(max_loras, h_out, rank, dtype=dtype, device=device)
            self.lora_a.append(a)
            self.lora_b.append(b)
            if self.lora_bt is not None:
                self.lora_bt.append(bt)
        # the stacks an activation writes: (layer, packed) -> (A stack, B stack in the host rows' layout)
        b_stacks = self.lora_bt if self.lora_bt is not None else self.lora_b
        self._stacks = {
            (layer, name): (self.lora_a[layer][name], b_stacks[layer][name])
            for layer in range(spec.num_layers)
            for name in packed
        }
        # [N] int64, host: the rank of the adapter in each row (its largest over modules): columns of A and B past
        # it are zero, and the CPU kernels skip them (a rank-8 adapter under max_lora_rank 64 costs rank 8)
        self.row_ranks = torch.full((max_loras,), rank, dtype=torch.int64)
        self._rows = _Rows(pins=[0] * max_loras, free=list(range(max_loras)))
        self._doomed: set[Key] = set()  # evicted while pinned: the row is freed at its last release
        self._host: OrderedDict[Key, HostAdapter] = OrderedDict()  # least recently used first
        self._loading: dict[Key, Future] = {}
        self._failed: dict[Key, AdapterError] = {}
        self._digests: dict[Key, str] = {}  # of every adapter ever loaded: it outlives the host copy
        self._lock = threading.Lock()
        self._loader = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="loraplex-adapter-loader", initializer=loader_setup
        )
        self.stats = AdapterCacheStats()

    # ---- host tier (any thread) ---------------------------------------------------------------------
    def read(self, lora: LoRARequest) -> HostAdapter:
        """Reads and validates the adapter from disk (raising AdapterError); changes nothing. See `store`."""
        start = time.perf_counter()
        weights = load_lora(lora.path, self.spec, self.max_lora_rank, self.allow_pickle, name=lora.adapter_id)
        self._check_fits(weights)
        rows = {}
        for name, modules in self.packed.items():
            rows.update(self._packed_rows(weights, name, modules))
        if self.device.type == "cuda":
            rows = {key: (a.pin_memory(), b.pin_memory()) for key, (a, b) in rows.items()}
        # only the rows are kept: the tensors as read, kept beside them, doubled the host memory of every adapter,
        # and a read beside a running engine page-faulted twice its size into being (~10 us a page on a young VM)
        return HostAdapter(replace(weights, weights={}), rows, time.perf_counter() - start)

    def _check_fits(self, weights: LoRAWeights) -> None:
        """Raises naming the first module whose A, or B times its scaling (as the rows hold them), passes the serving
        dtype's largest value, without converting anything: at once when the largest value `load_lora` measured
        fits times the largest scaling (the usual adapter), else module by module."""
        limit = torch.finfo(self.dtype).max
        largest_scaling = max((abs(s) for _, _, s in weights.weights.values()), default=1.0)
        if weights.largest * max(largest_scaling, 1.0) <= limit:
            return
        for (layer, module), (lora_a, lora_b, scaling) in sorted(weights.weights.items()):
            a_max, b_max = magnitudes([lora_a, lora_b])
            if a_max > limit or b_max * abs(scaling) > limit:
                raise AdapterError(
                    f"adapter {weights.name!r}: layer {layer} {module}: lora_A, or lora_B times its scaling "
                    f"{scaling:g}, overflows {self.dtype}, the dtype it is served in"
                )

    def _packed_rows(self, weights: LoRAWeights, name: str, modules: tuple[str, ...]):
        """(layer, name) -> (A row [S * R, H_in], B row [H_out, R], or [R, H_out] with transposed_b) for every
        layer. When every layer holds all of the packed modules at rank R (the usual adapter), the rows of all layers
        are views of one concatenation of A and one of B: a few ops, where a layer at a time took a few per layer
        (this runs beside the engine, on the loader thread); otherwise each layer's rows are padded."""
        layers, transposed_b = range(self.spec.num_layers), self.lora_bt is not None
        present = [weights.weights.get((layer, module)) for layer in layers for module in modules]
        if not all(p is not None and p[0].shape[0] == self.max_lora_rank for p in present):
            rows = {(layer, name): self._padded_rows(weights, layer, modules) for layer in layers}
            if transposed_b:
                rows = {key: (a, b.T.contiguous()) for key, (a, b) in rows.items()}
            return rows
        a = torch.cat([lora_a for lora_a, _, _ in present]).to(self.dtype)  # [L * S * R, H_in]
        scalings = {scaling for _, _, scaling in present}
        if len(scalings) == 1:  # the usual case: one lora_alpha / r for every module
            b = torch.cat([lora_b for _, lora_b, _ in present]).mul_(scalings.pop())  # [L * H_out, R]
        else:
            b = torch.cat([lora_b * scaling for _, lora_b, scaling in present])
        a_layers = a.view(len(layers), -1, a.shape[1])  # [L, S * R, H_in]
        b_layers = b.to(self.dtype).view(len(layers), -1, b.shape[1])  # [L, H_out, R]
        if transposed_b:
            b_layers = b_layers.transpose(1, 2).contiguous()  # [L, R, H_out]
        return dict(zip([(layer, name) for layer in layers], zip(a_layers.unbind(0), b_layers.unbind(0)), strict=True))

    def _padded_rows(self, weights: LoRAWeights, layer: int, modules: tuple[str, ...]):
        rank, shapes = self.max_lora_rank, self.spec.module_shapes
        a = torch.zeros(len(modules) * rank, shapes[modules[0]][0], dtype=self.dtype)  # [S * R, H_in]
        b = torch.zeros(sum(shapes[m][1] for m in modules), rank, dtype=self.dtype)  # [H_out, R]
        offset = 0
        for s, module in enumerate(modules):
            if (layer, module) in weights.weights:
                lora_a, lora_b, scaling = weights.weights[(layer, module)]  # [r, in], [out, r]
                r = lora_a.shape[0]
                a_rows, b_rows = a[s * rank : s * rank + r], b[offset : offset + lora_b.shape[0], :r]
                a_rows.copy_(lora_a)
                b_rows.copy_(lora_b * scaling)  # may overflow the serving dtype: `read` checks
            offset += shapes[module][1]
        return a, b

    def store(self, lora: LoRARequest, host: HostAdapter) -> LoRAWeights:
        """Puts what `read` returned in the host tier (most recently used), dropping the least recently used
        beyond max_cpu_loras."""
        with self._lock:
            self._host[lora.key] = host
            self._host.move_to_end(lora.key)
            self._failed.pop(lora.key, None)  # read well now: a past failure no longer stands
            self._digests[lora.key] = host.weights.digest
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
                self.stats.host_evictions += 1
            self.stats.loads += 1
            self.stats.load_seconds += host.load_seconds
        logger.info(
            "adapter '%s' loaded to host memory in %.0f ms (rank %d, %s)",
            lora.adapter_id,
            host.load_seconds * 1e3,
            host.weights.rank,
            host.weights.digest[:19],
        )
        return host.weights

    def load(self, lora: LoRARequest) -> LoRAWeights:
        """Reads and validates now (raising AdapterError) unless it is in host memory, where it stays (most
        recently used)."""
        with self._lock:
            host = self._host.get(lora.key)
            if host is not None:
                self._host.move_to_end(lora.key)
                return host.weights
        return self.store(lora, self.read(lora))

    def host_weights(self, lora: LoRARequest) -> LoRAWeights | None:
        """The adapter's weights while it is in host memory."""
        with self._lock:
            host = self._host.get(lora.key)
            return None if host is None else host.weights

    def prefetch(self, lora: LoRARequest) -> None:
        """Starts loading in the background unless it is resident, on the host, loading, or failed."""
        with self._lock:
            if lora.key in self._host or lora.key in self._loading or lora.key in self._failed:
                return
            self._loading[lora.key] = self._loader.submit(self._load_in_background, lora)

    def _load_in_background(self, lora: LoRARequest) -> None:
        try:
            self.store(lora, self.read(lora))
        except AdapterError as e:
            logger.warning("%s", e)
            with self._lock:
                self._failed[lora.key] = e
                self.stats.failures += 1
        except Exception as e:  # an unexpected failure must not leave requests waiting forever
            logger.exception("loading adapter '%s' failed", lora.adapter_id)
            with self._lock:
                self._failed[lora.key] = AdapterError(f"adapter '{lora.adapter_id}': {e}")
                self.stats.failures += 1
        finally:
            with self._lock:
                self._loading.pop(lora.key, None)

    def is_resident(self, lora: LoRARequest) -> bool:
        return lora.key in self._rows.row_of

    def on_host(self, lora: LoRARequest) -> bool:
        with self._lock:
            return lora.key in self._host

    def digest(self, lora: LoRARequest) -> str | None:
        """The content digest once the adapter has been loaded (it may since have left host memory)."""
        with self._lock:
            return self._digests.get(lora.key)

    # ---- device rows (engine thread only) -----------------------------------------------------------
    def acquire(self, lora: LoRARequest) -> int | None:
        """Pins the adapter's device row and returns its adapter_idx; None while it is not in host memory yet
        (see `prefetch`) or every row is pinned by running sequences. Raises the AdapterError of a failed load."""
        rows = self._rows
        if lora.key in self._doomed:
            return None  # evicted while running sequences pin it: reloaded once they release the row
        with self._lock:
            failure = self._failed.get(lora.key)
            host = self._host.get(lora.key)
            if host is not None:
                self._host.move_to_end(lora.key)  # used: the host tier's LRU order follows use, not loading
        row = rows.row_of.get(lora.key)
        if row is None:
            if failure is not None:
                raise failure
            if host is None:
                return None
            row = self._free_row()
            if row is None:
                return None
            self._activate(row, host)
            rows.row_of[lora.key] = row
        rows.row_of.move_to_end(lora.key)
        rows.pins[row] += 1
        return row

    def _free_row(self) -> int | None:
        rows = self._rows
        if rows.free:
            return rows.free.pop()
        victim = next((key for key, row in rows.row_of.items() if rows.pins[row] == 0), None)
        if victim is None:
            return None
        self.stats.device_evictions += 1
        return rows.row_of.pop(victim)

    def _activate(self, row: int, host: HostAdapter) -> None:
        for key, (a, b) in host.rows.items():
            a_stack, b_stack = self._stacks[key]
            a_stack[row].copy_(a)  # synchronous: the host tier may drop `a` right after
            b_stack[row].copy_(b)
        self.row_ranks[row] = host.weights.rank
        self.stats.activations += 1

    def release(self, adapter_idx: int) -> None:
        rows = self._rows
        assert rows.pins[adapter_idx] > 0, f"adapter row {adapter_idx} is not pinned"
        rows.pins[adapter_idx] -= 1
        if rows.pins[adapter_idx] == 0 and self._doomed:
            key = next((k for k, row in rows.row_of.items() if row == adapter_idx), None)
            if key in self._doomed:
                self._free(key)

    def unload(self, lora: LoRARequest) -> bool:
        """Frees the adapter's device row (it stays in host memory): now, or at the last release while running
        sequences pin it. Returns whether the row is still pinned (the unload then completes later)."""
        row = self._rows.row_of.get(lora.key)
        if row is not None and self._rows.pins[row]:
            self._doomed.add(lora.key)
            return True
        if row is not None:
            self._free(lora.key)
        return False

    def evict(self, lora: LoRARequest) -> bool:
        """Forgets the adapter in every tier (host copy, digest, a past failure) so that the next use reads the
        directory again; its device row is freed now, or at the last release while running sequences pin it.
        Returns whether the row is still pinned (the eviction then completes later)."""
        with self._lock:
            self._host.pop(lora.key, None)
            self._failed.pop(lora.key, None)
            self._digests.pop(lora.key, None)
        return self.unload(lora)

    def _free(self, key: Key) -> None:
        self._doomed.discard(key)
        row = self._rows.row_of.pop(key)
        self._rows.free.append(row)
        self.stats.device_evictions += 1
        logger.info("adapter '%s' left device row %d", key[0], row)

    def tier(self, lora: LoRARequest) -> str:
        """Where the adapter is now: "device", "host", "loading", "failed" or "disk"."""
        if lora.key in self._rows.row_of and lora.key not in self._doomed:
            return "device"
        with self._lock:
            if lora.key in self._host:
                return "host"
            if lora.key in self._loading:
                return "loading"
            return "failed" if lora.key in self._failed else "disk"

    def resident_keys(self) -> list[Key]:
        """Adapters on device rows (engine thread), least recently used first."""
        return [key for key in self._rows.row_of if key not in self._doomed]

    def host_keys(self) -> list[Key]:
        """Adapters in host memory, least recently used first."""
        with self._lock:
            return list(self._host)

    @property
    def num_on_host(self) -> int:
        with self._lock:
            return len(self._host)

    @property
    def num_staged(self) -> int:
        """Adapters loading, or in host memory without a device row: those a prefetch has put ahead of use."""
        with self._lock:
            return len(self._loading) + sum(1 for key in self._host if key not in self._rows.row_of)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._rows.pins if p)

    @property
    def num_resident(self) -> int:
        return len(self._rows.row_of)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
