#!/usr/bin/env bash
# Install (first time only) and launch Omni Studio. Two demos, both trained models that do what you ask:
#   ./scripts/studio.sh          the studio UI (and API) on `tiny-glm-shapes`, which draws what you ask
#   ./scripts/studio.sh speech   the studio on `tiny-qwen-omni-dtmf`, which dials what you ask: `dial 4 1 7`
#                                replies `4 1 7` and speaks the keys' DTMF tones (docs/tiny-qwen-omni-dtmf.md)
# Any other arguments: `omni-studio ARGS...` (its own default model is `tiny-glm-image`, the product default).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
bash scripts/setup.sh run
if [ "$#" -eq 0 ]; then
  echo "Demo: tiny-glm-shapes draws what you ask ('./scripts/studio.sh speech' for the speech demo)." >&2
  set -- ui --model tiny-glm-shapes
elif [ "$1" = "speech" ]; then
  shift
  echo "Demo: tiny-qwen-omni-dtmf dials what you ask (try 'dial 5 5 5 0 1 2 3' with audio on)." >&2
  set -- ui --model tiny-qwen-omni-dtmf "$@"
fi
exec .venv/bin/omni-studio "$@"
