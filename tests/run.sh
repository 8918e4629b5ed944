#!/usr/bin/env bash
# The whole test suite on a fresh machine: set up .venv with the pinned dependencies, lint, run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh dev
# Integration tests need real Redis and PostgreSQL binaries (tests/services.py starts its own servers from them).
has_postgres() { command -v initdb >/dev/null && command -v pg_ctl >/dev/null || ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; }
if ! command -v redis-server >/dev/null || ! has_postgres; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server postgresql >/dev/null
    else
        echo "tests need redis-server and PostgreSQL (initdb, pg_ctl): install them" >&2
    fi
fi
# The C++ CPU kernels (kernels/*/csrc) build with the machine's compiler; without one their tests skip.
if ! command -v c++ >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends g++ >/dev/null
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
