"""The C++ CPU kernels (paged_attention/csrc: the paged decode attention; lora/csrc: batched LoRA shrink and expand;
fused/csrc: RMSNorm, SiLU * up and rotary embedding, each fused; sampling/csrc: greedy argmax with the finiteness
check; linear/csrc: the fp32 linear on AVX2 CPUs; decode_stack/csrc: a decode step's layers), one extension built
once per checkout on first use, its ops under torch.ops.loraplex.

torch.utils.cpp_extension compiles it with the machine's C++ compiler (-O3 -march=native) into a build directory of
its own under torch's extension cache (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR), named by a key of the
sources' directory, their contents, the flags and torch's version (`build_directory`); later processes load that
build, and mark it used. One directory per checkout and version: two checkouts (a work tree and CI's clone) no
longer rebuild each other's (torch's one directory per name was rebuilt whenever the sources' paths changed), and
directories unused for STALE_BUILD_DIRECTORY_S are removed. Where it cannot be built (no compiler or ninja),
`load()` returns None once, with a log line, and callers keep the torch path. LORAPLEX_CPU_KERNELS=0 turns them off;
LORAPLEX_CPU_MARCH builds them for another target than this CPU (`CFLAGS`).
A process killed while building leaves torch's build lock behind, and every later build would wait on it forever: a
lock older than STALE_BUILD_LOCK_S (a build takes under a minute) is removed, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)
SOURCES = sorted(Path(__file__).parent.glob("*/csrc/*.cpp"))
_lock = threading.Lock()
_state: dict[str, Any] = {}
EXTENSION_NAME = "loraplex_cpu_kernels"
STALE_BUILD_LOCK_S = 600.0
STALE_BUILD_DIRECTORY_S = 7 * 86400.0  # a build directory untouched this long (its checkout gone) is removed
# LORAPLEX_CPU_MARCH: the compiler's target (native: this CPU's). Another one builds apart (the flags are in the build's
# key); x86-64-v3 on an AVX-512 host is how the tests run the kernels' AVX2 paths.
CFLAGS = ["-O3", f"-march={os.environ.get('LORAPLEX_CPU_MARCH', 'native')}", "-fopenmp"]
KERNELS_DIR = Path(__file__).parent


def load() -> Any:
    """torch.ops.loraplex with the compiled ops (paged_decode_attention, lora_shrink_cpu, lora_expand_cpu, the
    fused layer ops and greedy_tokens_cpu), or None where they cannot be built (or are turned off)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def load_with(available_op: str) -> Any:
    """torch.ops.loraplex where the kernels are built and their op `available_op` (a flag of the build, e.g.
    "packed_linear_available": whether the compiler's target had the instructions a kernel needs) says yes, else
    None."""
    native = load()
    return native if native is not None and getattr(native, available_op)() else None


def _build() -> Any:
    if os.environ.get("LORAPLEX_CPU_KERNELS", "1") == "0":
        logger.info("C++ CPU kernels off (LORAPLEX_CPU_KERNELS=0): attention and LoRA run on torch ops")
        return None
    start = time.perf_counter()
    try:
        import torch
        from torch.utils.cpp_extension import load as load_extension

        build_dir = build_directory()
        build_dir.mkdir(parents=True, exist_ok=True)
        os.utime(build_dir)  # used now: never taken for a stale one by another checkout's build
        remove_stale_build_lock(build_dir)
        remove_stale_build_directories(build_dir)
        load_extension(
            name=EXTENSION_NAME,
            sources=[str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            extra_include_paths=[str(KERNELS_DIR / "csrc")],  # cpu_vec.h, shared by the kernels
            build_directory=str(build_dir),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.loraplex.* (no pybind11: a much shorter build)
            verbose=False,
        )
        module = torch.ops.loraplex
    except Exception as e:  # a compiler, ninja or header problem: any of them means "not here"
        logger.warning("C++ CPU kernels unavailable (%s): attention and LoRA run on torch ops", e)
        return None
    elapsed = time.perf_counter() - start
    if elapsed > 2:
        logger.info("built the C++ CPU kernels in %.0f s (cached for later runs)", elapsed)
    return module


def build_directory(kernels_dir: Path = KERNELS_DIR) -> Path:
    """<torch's extension cache>/loraplex/<EXTENSION_NAME>-<key>: the key hashes kernels_dir's path, every C++ source
    and header under it, the flags and torch's version, so that a build is never mixed with another checkout's."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256(f"{kernels_dir.resolve()}\n{torch.__version__}\n{' '.join(CFLAGS)}\n".encode())
    for path in sorted(kernels_dir.glob("**/csrc/*")):
        digest.update(f"{path.relative_to(kernels_dir)}\n".encode())
        digest.update(path.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / "loraplex" / f"{EXTENSION_NAME}-{digest.hexdigest()[:16]}"


def remove_stale_build_directories(build_dir: Path, max_age_s: float = STALE_BUILD_DIRECTORY_S) -> list[Path]:
    """Removes build_dir's siblings (other checkouts' and versions' builds) neither used (their directory's time,
    which each load sets) nor written (their files' times) for max_age_s, and as old builds in torch's own one
    directory per name (<cache>/py311_cpu/loraplex_cpu_kernels, where they went before the keyed directories).
    Returns those it removed."""
    removed = []
    legacy = build_dir.parent.parent.glob(f"py*/{EXTENSION_NAME}")
    for sibling in [*build_dir.parent.glob(f"{EXTENSION_NAME}-*"), *legacy]:
        if sibling == build_dir or not sibling.is_dir():
            continue
        newest = max([sibling.stat().st_mtime, *(p.stat().st_mtime for p in sibling.rglob("*"))])
        if time.time() - newest > max_age_s:
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    if removed:
        logger.info("removed %d C++ kernel builds unused for %.0f days", len(removed), max_age_s / 86400)
    return removed


def remove_stale_build_lock(build_dir: Path, max_age_s: float = STALE_BUILD_LOCK_S) -> bool:
    """Removes torch's build lock in build_dir when it is older than max_age_s: its builder died (a build takes
    under a minute), and torch would wait on it forever. Returns whether it removed one."""
    lock = build_dir / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_s < max_age_s:
        return False
    lock.unlink(missing_ok=True)
    logger.warning("removed a stale build lock %s (%.0f s old: its build was killed) before building", lock, age_s)
    return True
