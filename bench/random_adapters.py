"""Random PEFT LoRA adapters for a base model, from its config alone: no base weights are read or allocated.

peft wraps the model built on the meta device once, which names every lora_A / lora_B tensor and gives its
shape; each adapter is then those tensors drawn afresh (seeded by its index) and saved as peft saves them:
`adapter_config.json` + `adapter_model.safetensors`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from bench import BenchError

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class AdapterShape:
    rank: int
    lora_alpha: float
    target_modules: tuple[str, ...] = ALL_MODULES
    dtype: str = "float16"  # of the saved tensors
    std: float = 0.02  # of each random A and B entry


def adapter_name(rank: int, index: int) -> str:
    return f"bench-r{rank}-{index}"


def write_random_adapters(
    model_dir: Path, out_dir: Path, count: int, shape: AdapterShape, show_progress: bool = True
) -> list[Path]:
    """Writes adapters `bench-r{rank}-{i}`, i < count, into out_dir; one already there with this shape is kept."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    paths = [out_dir / adapter_name(shape.rank, i) for i in range(count)]
    missing = [(i, p) for i, p in enumerate(paths) if not _matches(p, shape)]
    if not missing:
        return paths
    peft_model = _peft_model_on_meta(model_dir, shape)
    layout = {name: t.shape for name, t in get_peft_model_state_dict(peft_model).items()}  # name -> [r, in] / [out, r]
    config = peft_model.peft_config["default"]
    config.inference_mode = True  # as peft's own save_pretrained writes it
    for i, path in tqdm(missing, desc="writing adapters", unit="adapter", disable=not show_progress):
        g = torch.Generator().manual_seed(i)
        tensors = {n: (torch.randn(s, generator=g) * shape.std).to(DTYPES[shape.dtype]) for n, s in layout.items()}
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(path))  # adapter_config.json last: its presence marks the adapter complete
    return paths


def _peft_model_on_meta(model_dir: Path, shape: AdapterShape):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise BenchError(f"cannot build a causal LM from the config in --model {model_dir}: {e}") from e
    lora = LoraConfig(
        r=shape.rank,
        lora_alpha=shape.lora_alpha,
        target_modules=list(shape.target_modules),
        init_lora_weights=False,
        base_model_name_or_path=str(model_dir),
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise BenchError(f"peft cannot put LoRA on {list(shape.target_modules)} of {model_dir}: {e}") from e


def _matches(path: Path, shape: AdapterShape) -> bool:
    """Whether a complete adapter of this rank, alpha and targets is already at `path` (from an earlier sweep)."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        same = (config["r"], config["lora_alpha"], sorted(config["target_modules"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    wanted = (shape.rank, shape.lora_alpha, sorted(shape.target_modules))
    return same == wanted and (path / "adapter_model.safetensors").is_file()
