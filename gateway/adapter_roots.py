"""AdapterRoots: the directories adapters may be registered from; any other path is refused with a 422."""

from __future__ import annotations

from pathlib import Path

from gateway.errors import APIError


class AdapterRoots:
    def __init__(self, roots: list[str | Path] = ()):
        self.roots: list[Path] = []
        for root in roots:
            self.allow(root)

    def allow(self, root: str | Path) -> None:
        resolved = Path(root).expanduser().resolve()
        if resolved not in self.roots:
            self.roots.append(resolved)

    def resolve(self, path: str, param: str = "path") -> Path:
        """The real directory `path` names (links followed), if it lies under an allowed root."""
        if not path:
            raise APIError(422, "the adapter path is empty", param=param)
        resolved = Path(path).expanduser().resolve()
        if not any(resolved.is_relative_to(root) for root in self.roots):
            allowed = ", ".join(str(r) for r in self.roots) or "none configured: start the server with --adapter-root"
            raise APIError(422, f"adapter path {path!r} is outside the allowed adapter roots ({allowed})", param=param)
        if resolved.is_file() and resolved.suffix == ".gguf":
            raise APIError(
                422,
                f"adapter path {path!r} is a GGUF file: adapters are served in PEFT format, a directory with "
                "adapter_config.json and adapter_model.safetensors (GGUF is for the base model, --model)",
                param=param,
            )
        if not resolved.is_dir():
            raise APIError(422, f"adapter path {path!r} is not a directory", param=param)
        return resolved
