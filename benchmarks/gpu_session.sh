#!/usr/bin/env bash
# One device call's worth of GPU measurements (2×H200). Results go to $OUT (≤ 8 files).
#   bash benchmarks/gpu_session.sh models|sync|tests
set -uo pipefail
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
LOG=$OUT/session.log
run() { echo "### $*" | tee -a "$LOG"; "$@" 2>&1 | grep -v "Warning\|warnings.warn" | tail -60 | tee -a "$LOG"; }
case "${1:-models}" in
  models)
    nvidia-smi topo -m >> "$LOG" 2>&1
    python3 -c "import torch, vllm, megatron.core, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__)" >> "$LOG" 2>&1
    run timeout 170 torchrun --nproc-per-node 2 benchmarks/bench_model_gpu.py parity --out "$OUT/parity.json"
    run timeout 170 python3 benchmarks/bench_model_gpu.py throughput --out "$OUT/throughput.json"
    run timeout 220 python3 -m pytest -q -x tests/gpu/test_hybrid_gpu.py -p no:warnings
    ;;
  sync)
    run timeout 280 torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 2 --out "$OUT/sync_t2_tg2.json"
    run timeout 280 torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 1 --out "$OUT/sync_t2_tg1.json"
    ;;
esac
