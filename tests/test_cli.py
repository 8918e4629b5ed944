"""The README's main command: `loraplex generate` builds the embedded demo model once and generates."""

from __future__ import annotations

import shutil

import pytest

from loraplex import cli
from loraplex.demo.model import build_demo_model, demo_dir


def test_generate_with_the_embedded_demo_model(demo_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shutil.copytree(demo_model_dir, demo_dir())  # the session's build stands in for the first run's
    cli.main(["generate", "--prompt", "Alice was", "--max-tokens", "5"])
    out = capsys.readouterr().out
    assert "'Alice was' -> " in out and "[5 tokens, length]" in out
    built = list((tmp_path / "loraplex").iterdir())
    assert len(built) == 1 and (built[0] / "model.safetensors").is_file()
    mtime = (built[0] / "model.safetensors").stat().st_mtime
    assert build_demo_model() == built[0]  # cached: not rebuilt
    assert (built[0] / "model.safetensors").stat().st_mtime == mtime


def test_generate_with_a_model_directory_and_seed(demo_model_dir, capsys):
    directory = build_demo_model(demo_model_dir)  # already built: returned as is
    argv = [
        "generate",
        "--model",
        str(directory),
        "--prompt",
        "Call me",
        "--temperature",
        "1.0",
        "--seed",
        "7",
    ]
    cli.main(argv)
    first = capsys.readouterr().out
    cli.main(argv)
    assert capsys.readouterr().out.split("\n")[-2] == first.split("\n")[-2]


def test_generate_with_a_lora_adapter(demo_model_dir, tmp_path, capsys):
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    directory = demo_model_dir
    base = LlamaForCausalLM.from_pretrained(directory)
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(copy.deepcopy(base), config).save_pretrained(tmp_path / "adapter")
    argv = ["generate", "--model", str(directory), "--prompt", "Call me", "--max-tokens", "6"]
    cli.main(argv)
    plain = capsys.readouterr().out.strip().splitlines()[-1]
    cli.main([*argv, "--lora", f"demo={tmp_path / 'adapter'}"])
    adapted = capsys.readouterr().out.strip().splitlines()[-1]
    assert adapted.startswith("'Call me' -> ") and adapted != plain
    with pytest.raises(SystemExit, match="NAME=PATH"):
        cli.main([*argv, "--lora", "no-equals-sign"])


@pytest.mark.parametrize("bench", ["engine", "lora"])
def test_bench_commands_parse_their_own_options(bench, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", bench, "--help"])
    assert done.value.code == 0 and f"loraplex bench {bench}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--no-such-option"])
    assert done.value.code == 2 and "--no-such-option" in capsys.readouterr().err
