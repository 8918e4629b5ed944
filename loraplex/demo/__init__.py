"""The embedded demo: a base model and three behaviour adapters, built locally on first use and cached."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Demo:
    model: Path  # what `--model` takes
    adapters: dict[str, Path]  # adapter name -> PEFT directory


def build_demo() -> Demo:
    from loraplex.demo.model import build_demo_model, demo_adapters

    model = build_demo_model()
    return Demo(model, demo_adapters(model))
