#!/usr/bin/env bash
# The test command: install what is missing, lint, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/venv.sh  # the interpreter install.sh installed into
"$PYTHON" -m ruff check gpuctl training tests bench
# Two workers (pytest-xdist), one a core of the 2-core machine CI runs on.
# loadgroup keeps the tests of a module-scoped fixture in one worker (tests/conftest.py groups them).
"$PYTHON" -m pytest -q -n 2 --dist loadgroup "$@"
