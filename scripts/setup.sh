#!/usr/bin/env bash
# Install everything into .venv (repository root). Usage: scripts/setup.sh run|test
#   run  : the engine, studio and API, plus vLLM for AR stages
#   test : all of the above plus test tools, Debian's chromium (browser tests) and postgresql (store tests)
# Re-running is cheap: a stamp in .venv records what was installed for which inputs.
set -euo pipefail
mode="${1:-run}"
case "$mode" in run|test) ;; *) echo "usage: $0 run|test" >&2; exit 2 ;; esac
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

log() { printf '[setup] %s\n' "$*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      python_bin="$candidate"; break
    fi
  done
fi
[ -n "$python_bin" ] || { echo "Python 3.11 is required (set PYTHON=/path/to/python3.11)" >&2; exit 1; }

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

# System packages for the test suite: Debian's chromium for Playwright (never `playwright install`),
# PostgreSQL for the run store's multi-process tests.
if [ "$mode" = test ]; then
  missing=()
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
  if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    as_root apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

[ -x .venv/bin/python ] || { log "creating .venv with $python_bin"; "$python_bin" -m venv .venv; }
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

stamp_inputs="$(cat pyproject.toml scripts/setup.sh; echo "mode=$mode gpu=$has_gpu")"
stamp=".venv/.omni-setup-$(printf '%s' "$stamp_inputs" | sha256sum | cut -c1-16)-$mode"
if [ -f "$stamp" ]; then
  log "up to date ($stamp)"; exit 0
fi

"${pip[@]}" install --upgrade "pip>=24" >/dev/null

# torch first, pinned: on a CPU machine the CPU wheel (from /opt/wheels when present, else PyTorch's CPU
# index). An unpinned or unresolved torch would pull a multi-GB CUDA build.
if [ "$has_gpu" = 1 ]; then
  torch_src=()
elif [ -d /opt/wheels ] && ls /opt/wheels/torch-2.13.0* >/dev/null 2>&1; then
  torch_src=(--find-links /opt/wheels)
elif [ -n "${OMNI_TORCH_INDEX_URL:-}" ]; then
  # An index that serves CPU builds of torch (set by whoever sets up the machine; see CONTRIBUTING.md).
  torch_src=(--extra-index-url "$OMNI_TORCH_INDEX_URL")
else
  log "no local CPU torch wheel in /opt/wheels and no OMNI_TORCH_INDEX_URL: torch comes from pip's configured index"
  torch_src=()
fi
log "installing torch 2.13.0 ($([ "$has_gpu" = 1 ] && echo GPU || echo CPU) build)"
"${pip[@]}" install "${torch_src[@]}" "torch==2.13.0"

extras="studio"
[ "$mode" = test ] && extras="studio,test,ray"  # the Ray and object-store tests need the ray extra
log "installing omni-studio[$extras]"
"${pip[@]}" install "${torch_src[@]}" -e ".[$extras]"

# shellcheck source=scripts/install_vllm.sh
source scripts/install_vllm.sh
install_vllm "$has_gpu"

# Nothing may have swapped torch for another build (ray, s3fs and vLLM all arrive after it).
.venv/bin/python -c 'import sys, torch; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' \
  || { log "torch is no longer 2.13.0 after the installs: $(.venv/bin/python -c 'import torch; print(torch.__version__)')"; exit 1; }

rm -f .venv/.omni-setup-*-"$mode"
touch "$stamp"
log "done: $(.venv/bin/python -c 'import torch, transformers, diffusers; print(f"torch {torch.__version__}, transformers {transformers.__version__}, diffusers {diffusers.__version__}")')"
