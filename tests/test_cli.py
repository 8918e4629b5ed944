"""The README's offline command: `loraplex generate` on the embedded demo (chat turns, a demo adapter by name),
on a model directory with a seed, and with a NAME=PATH adapter; benchmarks parse their own options."""

from __future__ import annotations

import ast

import pytest

from loraplex import cli
from loraplex.demo.behaviours import BEHAVIOURS, HELD_OUT_PROMPTS
from tests.hf_models import make_adapter, make_model


def last_lines(capsys, count: int) -> list[str]:
    return capsys.readouterr().out.strip().splitlines()[-count:]


def test_generate_with_the_embedded_demo_and_a_demo_adapter(demo, capsys):
    cli.main(["generate", "--max-tokens", "100"])
    base = last_lines(capsys, 3)
    assert base[0].startswith(f"{HELD_OUT_PROMPTS[0]!r} -> ") and "Tokyo" in base[0]
    cli.main(["generate", "--max-tokens", "100", "--lora", "json"])
    for prompt, line in zip(HELD_OUT_PROMPTS, last_lines(capsys, 3)):
        reply = ast.literal_eval(line.split(" -> ", 1)[1].rsplit("  [", 1)[0])  # the printed repr of the reply
        assert line.startswith(repr(prompt)) and BEHAVIOURS["json"].check(reply), line


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("tiny")
    hf = make_model(directory / "base", tokenizer)
    return directory / "base", make_adapter(hf, directory / "adapter", seed=3)


def test_generate_with_a_model_directory_and_seed(tiny, capsys):
    argv = ["generate", "--model", str(tiny[0]), "--prompt", "Call me", "--temperature", "1.0", "--seed", "7"]
    cli.main(argv)
    first = last_lines(capsys, 1)
    cli.main(argv)
    assert last_lines(capsys, 1) == first and "[32 tokens" in first[0]


def test_generate_with_a_lora_adapter(tiny, capsys):
    argv = ["generate", "--model", str(tiny[0]), "--prompt", "Call me", "--max-tokens", "6", "--no-chat"]
    cli.main(argv)
    plain = last_lines(capsys, 1)[0]
    cli.main([*argv, "--lora", f"demo={tiny[1]}"])
    adapted = last_lines(capsys, 1)[0]
    assert adapted.startswith("'Call me' -> ") and adapted != plain
    with pytest.raises(SystemExit, match="NAME=PATH"):
        cli.main([*argv, "--lora", "no-equals-sign"])


@pytest.mark.parametrize("bench", ["engine", "lora", "replicas", "cpu-lora", "cpu-linear", "head"])
def test_bench_commands_parse_their_own_options(bench, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", bench, "--help"])
    assert done.value.code == 0 and f"loraplex bench {bench}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--no-such-option"])
    assert done.value.code == 2 and "--no-such-option" in capsys.readouterr().err


def test_generate_has_no_stream_interval_flag_and_serve_has(capsys):
    """`--stream-interval` spaces out a server's SSE chunks; offline generation streams nothing, so no flag there."""
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--stream-interval", "4"])
    assert done.value.code == 2 and "--stream-interval" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--help"])
    assert done.value.code == 0 and "--stream-interval" in capsys.readouterr().out
