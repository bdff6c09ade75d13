#!/usr/bin/env bash
# GPU session A: checkpoint save vs write; streamed scoring with a 20 ms reward
set -x
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt
python -c "import torch, vllm, megatron.core as m; print(torch.__version__, vllm.__version__, m.__version__)" >> $OUT/gpu.txt 2>&1
timeout 250 python benchmarks/bench_checkpoint_checksums.py --hidden 1536 --layers 28 --repeats 1 --threads 1,auto --out $OUT/ckpt_gpu.json > $OUT/ckpt.log 2>&1; echo "ckpt rc=$?"
tail -6 $OUT/ckpt.log
rm -rf /tmp/ckpt-bench-*
timeout 300 torchrun --nproc-per-node 1 benchmarks/bench_colocated_streaming.py --prompts 32 --pairs 2 --modes sync,stream-reward,stream --reward-delay-ms 20 --out $OUT/stream20.json > $OUT/stream20.log 2>&1; echo "stream rc=$?"
tail -15 $OUT/stream20.log
