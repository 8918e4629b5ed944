"""FastLaunch: a Triton kernel launched through its compiled kernel, without the JIT's per-call argument binding.

`jit_fn[grid](*args)` binds every argument, specializes it, builds a cache key string and looks the compiled
kernel up on each call: on an H100 host that was 28 µs of Python per launch against 9 µs for the compiled kernel's
own launcher, and an eager LoRA step launches two kernels per projection and layer. FastLaunch keeps the compiled
kernel per key of its own (each tensor's dtype and whether its address is a multiple of 16, every other argument
as it is: what Triton specializes on, or finer) and calls its launcher directly; the first call of a key goes
through the JIT, which compiles or finds the kernel and returns it.

The JIT path is kept whenever the direct one does not apply: under Triton's CPU interpreter, with a launch hook
installed at the first launch (a profiler such as proton; one installed later sees only new keys' launches), or
when a Triton version's compiled kernel lacks the launcher's inputs.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

ALIGN = 16  # Triton specializes a pointer on whether it is a multiple of 16 bytes


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors, which the kernels size their grids against (1 off CUDA: Triton's CPU
    interpreter, where no grid is sized for speed)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class FastLaunch:
    def __init__(self, jit_fn, **launch_options):
        """`jit_fn`: a @triton.jit function; `launch_options`: num_warps, num_stages... as for jit_fn[grid]."""
        self.jit_fn = jit_fn
        self.launch_options = launch_options
        self.compiled: dict[tuple, object] = {}
        self.direct = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

    def __call__(self, grid: Sequence[int], *args) -> None:
        """jit_fn[grid](*args, **launch_options): every argument positional, in the kernel's order, constexprs too."""
        if not self.direct:
            self.jit_fn[tuple(grid)](*args, **self.launch_options)
            return
        key = (
            torch.cuda.current_device(),  # a compiled kernel is loaded on one device: Triton launches on the current
            *((a.dtype, a.data_ptr() % ALIGN == 0) if isinstance(a, torch.Tensor) else a for a in args),
        )
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.jit_fn[tuple(grid)](*args, **self.launch_options)
            self._keep(key, kernel)
            return
        grid_y = grid[1] if len(grid) > 1 else 1
        grid_z = grid[2] if len(grid) > 2 else 1
        stream = torch.cuda.current_stream().cuda_stream
        kernel.run(grid[0], grid_y, grid_z, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)

    def _keep(self, key: tuple, kernel) -> None:
        """Keeps the kernel the JIT returned for key, when its launcher can be called directly."""
        try:
            from triton import knobs

            hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        except (ImportError, AttributeError):  # a Triton without knobs: its launcher's inputs may differ too
            hooks = (True,)
        hooked = any(getattr(hook, "calls", hook) for hook in hooks)  # None or an empty HookChain: no hook
        if hooked or not all(
            getattr(kernel, name, None) is not None for name in ("run", "function", "packed_metadata")
        ):
            self.direct = False
            why = "a launch hook is installed" if hooked else "this Triton's compiled kernel has no launcher to call"
            logger.info("Triton kernel %s launches through the JIT: %s", self.jit_fn.__name__, why)
            return
        self.compiled[key] = kernel
