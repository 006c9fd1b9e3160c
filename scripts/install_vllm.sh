# Sourced by scripts/setup.sh: install vLLM for AR stages.
# (Filled in by the vLLM backend work; until then AR stages run on transformers.)
install_vllm() {
  :
}
