"""Once an engine is built, the startup heap (torch, transformers, the model) is out of the collector's walks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.hf_models import make_model

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_the_startup_heap_is_frozen_once_the_engine_is_built(tmp_path, tokenizer):
    make_model(tmp_path, tokenizer)
    # a fresh process: the freeze is once per process, and this one's is long done
    code = textwrap.dedent(f"""
        import gc
        from engine.llm import LLM
        assert gc.get_freeze_count() == 0
        llm = LLM(model={str(tmp_path)!r}, device="cpu", dtype="float32", max_model_len=64)
        model = llm.engine.runner.model
        assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
        assert not any(o is model for o in gc.get_objects())  # frozen: no generation holds it any more
        garbage = []
        garbage.append(garbage)  # a cycle made after startup is still collected
        del garbage
        assert gc.collect() >= 1
        from engine.sampling_params import SamplingParams
        out = llm.generate(["hello there"], SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
    """)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, timeout=300)
