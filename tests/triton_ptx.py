"""Test-only: compiles one of our Triton kernels for Hopper (sm_90) without a GPU and prints its global memory
accesses as JSON, {PTX instruction: count} (cp.async included), so a test can see how a kernel moves its bytes.

    python tests/triton_ptx.py '{"kernel": "module:name", "launch": "MODULE_CONSTANT", "pointers": {...},
                                 "ints": {...}, "constexprs": {...}}'

Run outside Triton's interpreter (TRITON_INTERPRET unset): it needs the JIT's kernels. Pointers are marked 16-byte
aligned and ints that are multiples of 16 so, as the JIT specializes them; ints equal to 1 become constants. Exits
3, saying why, where this Triton cannot compile for sm_90 (no CUDA backend or no ptxas).
"""

import importlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    spec = json.loads(sys.argv[1])
    module_name, kernel_name = spec["kernel"].split(":")
    module = importlib.import_module(module_name)
    kernel = getattr(module, kernel_name)
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in spec["pointers"]:
            signature[name], attrs[(i,)] = spec["pointers"][name], [["tt.divisibility", 16]]
        elif spec["ints"].get(name) == 1:
            signature[name], constants[name] = "constexpr", 1
        elif name in spec["ints"]:
            signature[name] = "i32"
            if spec["ints"][name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name], constants[name] = "constexpr", spec["constexprs"][name]
    try:
        compiled = triton_compile(
            ASTSource(kernel, signature, constants, attrs),
            target=GPUTarget("cuda", 90, 32),
            options=getattr(module, spec["launch"]),
        )
    except (ImportError, RuntimeError, FileNotFoundError) as e:
        print(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {e}")
        sys.exit(3)
    accesses: dict[str, int] = {}
    for found in re.findall(r"(?:ld|st)\.global[.\w]*|cp\.async\.cg[.\w]*", compiled.asm["ptx"]):
        accesses[found] = accesses.get(found, 0) + 1
    print(json.dumps(accesses))


if __name__ == "__main__":
    main()
