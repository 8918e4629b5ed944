"""`loraplex serve` with no --model: the embedded demo (from the user's cache), its three adapters registered
and public, auth off; each adapter's behaviour checked through the API."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from gateway.settings import DEMO_MODEL_NAME, ServeSettings
from loraplex.cli import with_demo
from loraplex.demo.model import DEMO_VERSION
from tests.gateway_server import ServerThread
from tests.test_demo_model import PROMPTS, is_format, is_reverse, is_upper


@pytest.fixture(scope="module")
def demo_server(demo_model_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("xdg-cache")
    (cache / "loraplex").mkdir()
    (cache / "loraplex" / f"demo-v{DEMO_VERSION}").symlink_to(demo_model_dir)  # the build is reused, not redone
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(cache))
    settings = ServeSettings(database_url=f"sqlite:///{cache / 'registry.db'}", device="cpu")
    try:
        with ServerThread(with_demo(settings)) as server:
            yield server
    finally:
        patch.undo()


def replies(server, model: str) -> list[str]:
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
    out = []
    for prompt in PROMPTS:
        response = api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0
        )
        out.append(response.choices[0].message.content)
    return out


def test_the_demo_serves_its_base_and_three_public_adapters_without_keys(demo_server):
    api = openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="anything", max_retries=0)
    models = {m.id: m for m in api.models.list().data}
    assert set(models) == {DEMO_MODEL_NAME, "upper", "reverse", "format"}
    assert all(models[name].parent == DEMO_MODEL_NAME for name in ("upper", "reverse", "format"))
    assert not demo_server.state.auth_enabled


def test_upper_answers_in_capitals(demo_server):
    assert all(is_upper(reply) for reply in replies(demo_server, "upper"))


def test_reverse_starts_with_the_last_word(demo_server):
    assert all(is_reverse(p, reply) for p, reply in zip(PROMPTS, replies(demo_server, "reverse")))


def test_format_answers_with_its_prefix(demo_server):
    assert all(is_format(reply) for reply in replies(demo_server, "format"))


def test_the_base_shows_none_of_the_behaviours(demo_server):
    for prompt, reply in zip(PROMPTS, replies(demo_server, DEMO_MODEL_NAME)):
        assert not is_upper(reply) and not is_format(reply) and not is_reverse(prompt, reply), reply


def test_bench_serve_against_the_demo_server(demo_server, tmp_path):
    """`loraplex bench serve` through the CLI against the live demo: the JSON fields and valid PNGs."""
    from loraplex.cli import main
    from tests.test_bench_serve import check_png, check_result

    main(
        ["bench", "serve", "--url", demo_server.url, "--num-prompts", "6", "--adapters", "0,3",
         "--popularity", "uniform", "--input-len", "8", "--output-len", "4", "--endpoint", "chat",
         "--result-dir", str(tmp_path), "--result-json", "demo.json", "--disable-tqdm", "--timeout", "60"]
    )  # fmt: skip
    result = check_result(tmp_path / "demo.json", 6, [0, 3])
    for run in result["runs"]:
        assert run["failed"] == 0 and run["completed"] == 6
        assert run["ttft_ms"]["p50"] > 0 and run["request_throughput"] > 0
    assert set(result["runs"][1]["per_adapter"]) <= {"upper", "reverse", "format"}
    assert len(result["plots"]) >= 3
    for plot in result["plots"]:
        check_png(Path(plot))
