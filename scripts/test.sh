#!/usr/bin/env bash
# Install what the tests need (from nothing) and run the whole suite. Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh test
export OMNI_STUDIO_TEST_MODEL_CACHE="${OMNI_STUDIO_TEST_MODEL_CACHE:-$root/.venv/omni-test-models}"
exec .venv/bin/python -m pytest -q -ra "$@"
