#!/usr/bin/env bash
# The test command: install what is missing, lint, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check gpuctl training tests bench
python3 -m pytest -q "$@"
