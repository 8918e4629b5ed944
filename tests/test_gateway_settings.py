"""`loraplex serve` options: flags beat `LORAPLEX_*` environment variables beat defaults; --lora-modules in
both forms; sizes; the parser's help names every setting and its environment variable; the engine's options of
serve and generate are EngineConfig's (names, defaults, help), declared once."""

from __future__ import annotations

import dataclasses
import os

import pytest

from adapters.ref import parse_lora_module
from engine.config import EngineConfig
from gateway.settings import ENGINE_OPTIONS, ENV_PREFIX, ServeSettings, parse_size
from loraplex.cli import GENERATE_SKIPS, _engine_settings, _settings, build_parser


def settings(argv: list[str]) -> ServeSettings:
    return _settings(build_parser().parse_args(["serve", *argv]))


def generate_settings(argv: list[str]):
    return _engine_settings(build_parser().parse_args(["generate", *argv]))


@pytest.fixture
def no_loraplex_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def test_flags_beat_environment_beat_defaults(monkeypatch):
    monkeypatch.setenv("LORAPLEX_PORT", "9001")
    monkeypatch.setenv("LORAPLEX_MAX_LORAS", "7")
    monkeypatch.setenv("LORAPLEX_LORA_MODULES", '["env=/a"]')
    monkeypatch.setenv("LORAPLEX_DISABLE_AUTH", "true")
    got = settings(["--port", "9002", "--adapter-root", "/r1", "--adapter-root", "/r2"])
    assert got.port == 9002 and got.max_loras == 7 and got.lora_modules == ["env=/a"]
    assert got.adapter_root == ["/r1", "/r2"] and got.disable_auth is True and not got.auth_enabled
    assert settings([]).max_lora_rank == ServeSettings.model_fields["max_lora_rank"].default
    flags = settings(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--no-disable-auth"])
    assert flags.lora_modules == ["a=/x", '{"name": "b", "path": "/y"}'] and flags.auth_enabled


def test_auth_defaults_off_for_the_demo_and_on_with_a_model(tmp_path):
    assert not ServeSettings().auth_enabled
    assert ServeSettings(model=str(tmp_path)).auth_enabled


def test_bad_values_exit_with_the_setting_named(monkeypatch):
    monkeypatch.setenv("LORAPLEX_PORT", "not-a-port")
    with pytest.raises(SystemExit, match="port"):
        settings([])
    with pytest.raises(SystemExit):  # argparse names the flag
        settings(["--max-loras", "many"])
    with pytest.raises(ValueError, match="invalid size"):
        parse_size("lots")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("sql=/adapters/sql", ("sql", "/adapters/sql")),
        ('{"name": "chat", "path": "/a/chat", "base_model_name": "llama"}', ("chat", "/a/chat")),
    ],
)
def test_lora_module_forms(spec, expected):
    assert parse_lora_module(spec) == expected


@pytest.mark.parametrize("spec", ["sql", "=/x", "sql=", '{"name": "x"}', "{not json"])
def test_bad_lora_modules_are_refused_clearly(spec):
    with pytest.raises(ValueError, match="lora-modules"):
        parse_lora_module(spec)


@pytest.mark.parametrize(("text", "size"), [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1G", 2**30), ("100", 100)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_help_names_every_setting_and_its_environment_variable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out.replace("\n", " ")
    for name in ServeSettings.model_fields:
        if name != "log_level":
            assert "--" + name.replace("_", "-") in text and ENV_PREFIX + name.upper() in text.replace(" ", "")


def test_the_default_registry_is_one_sqlite_file_per_served_model(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    demo, llama, named = (
        ServeSettings().database_url,
        ServeSettings(model="/models/llama").database_url,
        ServeSettings(model="/models/llama", served_model_name="llama").database_url,
    )
    assert len({demo, llama, named}) == 3
    assert all(url.startswith(f"sqlite:///{tmp_path}/loraplex/registry-") for url in (demo, llama, named))
    assert ServeSettings(database_url="postgresql://db/x").database_url == "postgresql://db/x"


def test_engine_options_of_serve_and_generate_come_from_engine_config(no_loraplex_environment, monkeypatch, capsys):
    """Every EngineConfig field a user may set (all but the model and enable_lora, which the caller sets) is a serve
    flag and a LORAPLEX_* variable, and a generate flag (but GENERATE_SKIPS: generate's --seed is the sampling seed,
    and it streams nothing), with EngineConfig's default and help."""
    options = [f for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "enable_lora")]
    monkeypatch.setenv("COLUMNS", "1000")  # help lines unwrapped
    assert [f.name for f in options] == list(ENGINE_OPTIONS)
    serve, generate = settings([]), generate_settings([])
    for parser in ("serve", "generate"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([parser, "--help"])
        helps = capsys.readouterr().out.replace("\n", " ")
        helps = " ".join(helps.split())
        for option in options:
            if not (parser == "generate" and option.name in GENERATE_SKIPS):
                assert "--" + option.name.replace("_", "-") in helps, (parser, option.name)
                assert " ".join(option.metadata["help"].split()) in helps, (parser, option.name)
    for option in options:
        assert ServeSettings.model_fields[option.name].default == option.default, option.name
        assert getattr(serve, option.name) == option.default, option.name
        assert getattr(generate, option.name) == option.default, option.name
    assert generate.max_lora_rank == serve.max_lora_rank == EngineConfig.__dataclass_fields__["max_lora_rank"].default
    assert build_parser().parse_args(["generate", "--seed", "7"]).seed == 7  # the sampling seed ...
    assert generate_settings(["--seed", "7"]).seed == 0  # ... not the engine's


def test_engine_flags_reach_the_engine_config_alike_from_serve_and_generate(
    no_loraplex_environment, monkeypatch, tmp_path
):
    argv = ["--dtype", "float32", "--device", "cpu", "--block-size", "32", "--kv-cache-memory", "2GiB"]
    argv += ["--no-enable-prefix-caching", "--max-lora-rank", "64", "--max-loras", "2", "--cpu-threads", "1"]
    serve, generate = settings(argv), generate_settings(argv)
    assert serve.engine_options() == generate.engine_options()
    config = serve.engine_config(str(tmp_path), enable_lora=True)
    assert (config.dtype, config.device, config.block_size, config.kv_cache_memory) == ("float32", "cpu", 32, 2 * 2**30)
    assert not config.enable_prefix_caching and (config.max_lora_rank, config.max_loras, config.cpu_threads) == (
        64,
        2,
        1,
    )
    assert config.enable_lora and config.max_cpu_loras == 8  # resolved by EngineConfig: 4 x max_loras
    monkeypatch.setenv("LORAPLEX_BLOCK_SIZE", "64")
    monkeypatch.setenv("LORAPLEX_KV_CACHE_MEMORY", "512MiB")
    monkeypatch.setenv("LORAPLEX_LORA_BACKEND", "torch")
    from_env = settings([])
    assert (from_env.block_size, from_env.kv_cache_memory, from_env.lora_backend) == (64, 512 * 2**20, "torch")
    assert settings(["--block-size", "8"]).block_size == 8  # the flag wins
    for bad in (["--dtype", "fp8"], ["--kv-cache-memory", "lots"], ["--attention-backend", "cuda"]):
        with pytest.raises(SystemExit):
            settings(bad)
