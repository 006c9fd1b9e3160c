#!/usr/bin/env bash
# Install (first time only) and launch Omni Studio on the embedded tiny pipeline. Arguments go to omni-studio.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh run
exec .venv/bin/omni-studio "$@"
