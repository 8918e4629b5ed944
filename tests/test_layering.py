"""The rooms' walls: imports go one way (loraplex -> gateway, bench -> engine -> adapters, kernels; bench also
times the kernels alone; gateway -> registry and engine's interface module alone; kernels import nothing of ours),
read from the source with ast."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("loraplex", "gateway", "bench", "registry", "migrations", "engine", "adapters", "kernels")
ALLOWED = {  # package -> the packages of ours it may import
    "loraplex": {"gateway", "bench", "engine", "adapters", "registry"},
    "bench": {"engine", "adapters", "kernels"},  # `bench gpu` times the Triton kernels alone
    "gateway": {"registry", "engine"},
    "registry": set(),
    "migrations": {"registry"},
    "engine": {"adapters", "kernels"},
    "adapters": set(),
    "kernels": set(),
}


def imports_of(path: Path) -> set[str]:
    """Every module this file imports, absolute names (relative imports resolved within the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.add(node.module)
    return names


def ours(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def test_imports_go_one_way():
    wrong = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for module in imports_of(path):
                target = ours(module)
                if target and target != package and target not in ALLOWED[package]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_gateway_reaches_the_engine_through_its_interface_module_alone():
    reach = []
    for path in (ROOT / "gateway").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        reach += [
            f"{path.relative_to(ROOT)}: {m}"
            for m in imports_of(path)
            if m.startswith("engine") and m != "engine.interface"
        ]
        reach += [
            f"{path.relative_to(ROOT)}: {w}"
            for w in ("engine.engine", "adapter_cache", "scheduler", "block_manager")
            if re.search(rf"\b{re.escape(w)}\b", text)  # whole names: `adapter_cache_dir` is a setting
        ]
    assert not reach, "\n".join(reach)


def test_engine_adapters_and_kernels_import_no_web_or_database_library():
    for package in ("engine", "adapters", "kernels"):
        for path in (ROOT / package).rglob("*.py"):
            heavy = {
                m
                for m in imports_of(path)
                if m.split(".")[0] in {"fastapi", "starlette", "sqlalchemy", "redis", "uvicorn"}
            }
            assert not heavy, f"{path.relative_to(ROOT)} imports {heavy}"
