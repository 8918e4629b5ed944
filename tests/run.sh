#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up .venv with the pinned dependencies, lint, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
