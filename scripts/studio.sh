#!/usr/bin/env bash
# Install (first time only) and launch Omni Studio. With no arguments: the studio UI (and API) on the
# trained demo model `tiny-glm-shapes`, which draws what you ask. With arguments: `omni-studio ARGS...`
# (its own default model is `tiny-glm-image`, the product default).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh run
if [ "$#" -eq 0 ]; then
  set -- ui --model tiny-glm-shapes
fi
exec .venv/bin/omni-studio "$@"
