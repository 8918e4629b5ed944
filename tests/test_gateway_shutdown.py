"""SIGTERM under load: streams that can finish within `--timeout-graceful-shutdown` finish normally, streams that
cannot end with an SSE error event and `[DONE]` (not a bare close), and the process exits 0 without a traceback."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.gateway_server import ADMIN_KEY, BASE, ServerProcess
from tests.hf_models import make_model

CONTEXT = 16384
LONG_TOKENS = CONTEXT - 16  # 4 sequences × ~16k steps: minutes of work even on a fast machine, far past the drain


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("shutdown")
    make_model(root / "base", tokenizer, "llama", max_position_embeddings=CONTEXT)
    return root / "base"


def read_stream(url: str, max_tokens: int, events: list, first: threading.Event | None = None) -> None:
    body = {"model": BASE, "prompt": "Alice", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if first is not None:
                    first.set()


def test_sigterm_drains_finishes_short_streams_cuts_long_ones_with_an_error_event_and_exits_0(base_dir, tmp_path):
    log = tmp_path / "serve.log"
    args = [
        "--model", str(base_dir), "--served-model-name", BASE, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--database-url", f"sqlite:///{tmp_path / 'registry.db'}", "--admin-key", ADMIN_KEY, "--disable-auth",
        "--timeout-graceful-shutdown", "3", "--max-num-seqs", "4",
    ]  # fmt: skip
    with ServerProcess(args, log) as server:
        long_events: list = []
        short_events: list = []
        started = threading.Event()
        longs = [
            threading.Thread(target=read_stream, args=(server.url, LONG_TOKENS, long_events, started)) for _ in range(3)
        ]
        for thread in longs:
            thread.start()
        assert started.wait(60)
        # the short stream is under way (accepted, first token out) when the signal comes; 32 tokens fit the drain
        short_started = threading.Event()
        short = threading.Thread(target=read_stream, args=(server.url, 32, short_events, short_started))
        short.start()
        assert short_started.wait(60)
        server.process.send_signal(signal.SIGTERM)
        for thread in (*longs, short):
            thread.join(timeout=60)
        status = server.process.wait(timeout=60)
    text = log.read_text()
    assert status == 0, text[-3000:]
    assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length"
    errors = [event["error"] for event in long_events if isinstance(event, dict) and "error" in event]
    assert len(errors) == 3, long_events[-6:]
    assert all(e["code"] == "server_shutting_down" and "shutting down" in e["message"] for e in errors)
    assert long_events[-1] == "[DONE]"
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert "loraplex stopped" in text  # the lifespan ran to its end: usage flushed, engine and database closed
