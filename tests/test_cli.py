"""The README's main command: `loraplex generate` builds the embedded demo model once and generates."""

from __future__ import annotations

from gateway import cli
from gateway.demo.model import build_demo_model


def test_generate_with_the_embedded_demo_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cli.main(["generate", "--prompt", "Alice was", "--max-tokens", "5"])
    out = capsys.readouterr().out
    assert "'Alice was' -> " in out and "[5 tokens, length]" in out
    built = list((tmp_path / "loraplex").iterdir())
    assert len(built) == 1 and (built[0] / "model.safetensors").is_file()
    mtime = (built[0] / "model.safetensors").stat().st_mtime
    assert build_demo_model() == built[0]  # cached: not rebuilt
    assert (built[0] / "model.safetensors").stat().st_mtime == mtime


def test_generate_with_a_model_directory_and_seed(tmp_path, capsys):
    directory = build_demo_model(tmp_path / "m")
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
