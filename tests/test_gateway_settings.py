"""`loraplex serve` options: flags beat `LORAPLEX_*` environment variables beat defaults; --lora-modules in
both forms; sizes; the parser's help names every setting and its environment variable."""

from __future__ import annotations

import pytest

from gateway.adapter_service import parse_lora_module
from gateway.settings import ENV_PREFIX, ServeSettings, parse_size
from loraplex.cli import _settings, build_parser


def settings(argv: list[str]) -> ServeSettings:
    return _settings(build_parser().parse_args(["serve", *argv]))


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
