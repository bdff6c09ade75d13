#!/usr/bin/env bash
# One device call's worth of GPU measurements (2×H200). Results go to $OUT (≤ 8 files).
#   bash benchmarks/gpu_session.sh models|sync|rl|grpo|checks|tier|tier1|tier2|tier3|sample|moe|fwdbwd|pools|packedA|packedC|lora|
#                                    loraprof|fp8|grpoC1|grpoC1old|quant|stream20|streamrule|fp8tests|kv8|kv8long|grpo7lora|marlin|cq|blockcq|cqrollout|graphsync|decode
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
    run timeout 200 python3 -m pytest -q -x tests/gpu/test_hybrid_gpu.py -p no:warnings
    run timeout 280 torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 2 --out "$OUT/sync_t2_tg2.json"
    run timeout 280 torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 1 --out "$OUT/sync_t2_tg1.json"
    ;;
  rl)
    # the GRPO loop on GPUs with the tiny model: engine on CUDA, vLLM on CUDA, in-place weight sync over NCCL
    run timeout 200 torchrun --nproc-per-node 2 -m verl_mega.train --config configs/quickstart_cpu.yaml \
        parallel.tp=2 rollout.gen_tp=2 model.dtype=bfloat16 trainer.total_steps=20 trainer.output_dir=$OUT/rl \
        logging.progress_bar=false logging.tensorboard=false trainer.save_every=10 rollout.kv_cache_memory_bytes=null \
        rollout.gpu_memory_utilization=0.2 trainer.profile=true
    cp $OUT/rl/metrics.jsonl $OUT/rl_metrics.jsonl 2>/dev/null; rm -rf $OUT/rl
    run timeout 190 torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 2 --repeats 3 \
        --throughput-repeats 1 --out "$OUT/sync_t2_tg2.json"
    ;;
  grpo)
    # GRPO, 1.5B-class model, tp=tg=2, fixed-length generations: verl_mega vs the HF-generate baseline, same run
    nvidia-smi --query-gpu=name,memory.total --format=csv >> "$LOG" 2>&1
    run timeout ${GRPO_TIMEOUT:-450} torchrun --nproc-per-node 2 benchmarks/bench_grpo_gpu.py ${GRPO_ARGS:-} \
        --out "$OUT/grpo_1.5b.json"
    ;;
  moe)
    # Qwen3-30B-A3B architecture (8 of 48 layers), tp=1 dp=2 ep=2: fwd+bwd TFLOP/s on active params vs matmul peak,
    # 3D-HybridEngine expert sync into vLLM (bytes vs prediction), vLLM vs HF generate tokens/s
    nvidia-smi --query-gpu=name,memory.total --format=csv >> "$LOG" 2>&1
    run timeout ${MOE_TIMEOUT:-540} torchrun --nproc-per-node 2 benchmarks/bench_moe_gpu.py ${MOE_ARGS:-} \
        --out "$OUT/moe.json"
    ;;
  checks)
    run timeout 200 python3 -m pytest -q -x tests/gpu/test_hybrid_gpu.py -p no:warnings
    run timeout 200 torchrun --nproc-per-node 2 benchmarks/measure_memory_gpu.py --model qwen2.5-1.5b --pp 2 \
        --micro-batch 2 --seq-len 2048 --json "$OUT/memory_pp2.json"
    ;;
  tier)
    # the whole GPU tier in one go (more than one 10-minute device call on one GPU: tier1, tier2 and tier3 split it)
    nvidia-smi topo -m >> "$LOG" 2>&1
    python3 -c "import torch, vllm, megatron.core, transformers, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__)" >> "$LOG" 2>&1
    run timeout 520 python3 -m pytest -q -rs tests/gpu -p no:warnings
    ;;
  tier1|tier2|tier3)
    # the GPU tier in three parts, each within one device call (tests that need two GPUs skip with their reason):
    # tier1 every CPU recipe on the GPU; tier2 the 1.5B runs (PPO in bf16, configs/grpo_1gpu.yaml with its paths
    # alone); tier3 the rest (FP8 kernels and rollouts, LoRA, launchers, hybrid-engine parity, EP generation)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1
    python3 -c "import torch, vllm, megatron.core, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__)" >> "$LOG" 2>&1
    case "$1" in
      tier1) PART=(tests/gpu/test_recipes_gpu.py -k two_steps) ;;
      tier2) PART=(tests/gpu/test_recipes_gpu.py -k "1_5b or one_gpu") ;;
      tier3) PART=(tests/gpu --ignore tests/gpu/test_recipes_gpu.py) ;;
    esac
    run timeout ${TIER_TIMEOUT:-560} python3 -m pytest -q -rs "${PART[@]}" -p no:warnings --junitxml "$OUT/$1.xml"
    ;;
  fwdbwd)
    # 1.5B fwd+bwd on one GPU, side by side: our spec padded (fp32 CE / fused log-probs) and packed, mcore local,
    # HF + SDPA; then long-tailed lengths padded vs packed
    python3 -c "import torch, vllm, megatron.core, transformers; print('torch', torch.__version__, 'vllm', vllm.__version__, 'mcore', megatron.core.__version__, 'transformers', transformers.__version__)" >> "$LOG" 2>&1
    mkdir -p "$OUT/profiles"
    run timeout 300 python3 benchmarks/bench_model_gpu.py throughput --out "$OUT/fwdbwd_1.5b.json" --profile-dir "$OUT/profiles"
    ;;
  pools)
    # weights trainer (GPU 0, Megatron) → rollout pool (GPU 1, vLLM's layout), 7B bf16: buckets vs gather+broadcast
    run timeout 300 torchrun --nproc-per-node 2 benchmarks/bench_pool_transfer.py --out "$OUT/pool_transfer_7b.json"
    run timeout 200 torchrun --nproc-per-node 2 benchmarks/bench_pool_transfer.py --bucket-mb 128 --out "$OUT/pool_transfer_7b_b128.json"
    ;;
  packedA|packedC)
    # GRPO A (32 prompts × 8, ≤512 tokens) or C (16 × 8, ≤1024 tokens, two tg=1 engines), long-tailed lengths,
    # training at tp=1 with dp=2 on packed sequences under a token budget; the HF-generate baseline in the same run
    if [ "$1" = packedA ]; then SHAPE="--response-length 512 --prompts 32"; else SHAPE="--response-length 1024 --prompts 16"; fi
    run timeout ${GRPO_TIMEOUT:-540} torchrun --nproc-per-node ${NPROC:-2} benchmarks/bench_grpo_gpu.py --gen-tp 1 $SHAPE \
        --lengths ${LENGTHS:-lognormal} --warmup ${WARMUP:-2} --baseline-steps 1 --steps ${STEPS:-3} --out "$OUT/grpo_$1_${LENGTHS:-lognormal}.json" parallel.tp=1 model.use_remove_padding=true \
        actor.use_dynamic_bsz=true actor.max_tokens_per_gpu=16384 actor.micro_batch_size_per_gpu=16 \
        actor.log_prob_micro_batch_size_per_gpu=16 ${GRPO_EXTRA:-}
    ;;
  sample)
    # GRPO config C (1.5B-class, tp=2, two tg=1 engines, 16 prompts × 8 × 1024 tokens) with the step profile on:
    # the rollout's postprocess is the sample path (table all-reduce, all_to_all of rows, packing)
    run timeout ${GRPO_TIMEOUT:-520} torchrun --nproc-per-node 2 benchmarks/bench_grpo_gpu.py --gen-tp 1 \
        --response-length 1024 --prompts 16 --baseline-steps 1 --out "$OUT/grpo_C_profile.json" \
        actor.use_dynamic_bsz=true actor.max_tokens_per_gpu=12288 actor.log_prob_micro_batch_size_per_gpu=8 \
        trainer.profile=true
    ;;
  lora)
    # LoRA r=16 vs full fine-tuning, Qwen2.5-7B architecture (random bf16), one GPU: step time, peak memory, sync time
    nvidia-smi --query-gpu=name,memory.total --format=csv >> "$LOG" 2>&1
    run timeout 500 python3 benchmarks/bench_lora_gpu.py --out "$OUT/lora_7b.json"
    run timeout 300 python3 -m pytest -q -x tests/gpu/test_lora_gpu.py -p no:warnings
    ;;
  loraprof)
    # the LoRA step's operators (Qwen2.5-7B architecture, 14 layers), then vLLM's own LoRA (sync + generation)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1
    run timeout ${LORA_TIMEOUT:-200} python3 benchmarks/bench_lora_gpu.py --mode lora --layers 14 --steps 3 --profile \
        ${LORA_ARGS:-} --out "$OUT/lora14_lora.json"
    run timeout ${LORA_TIMEOUT:-200} python3 benchmarks/bench_lora_gpu.py --mode adapter --layers 14 --steps 2 \
        ${LORA_ARGS:-} --out "$OUT/lora14_adapter.json"
    ;;
  fp8)
    # FP8 rollout at the Qwen2.5-7B architecture: bf16 / FP8 weights / FP8 weights + FP8 KV cache, side by side
    run timeout ${FP8_TIMEOUT:-420} python3 benchmarks/bench_fp8_rollout_gpu.py --variants bf16,fp8,fp8_kv8 \
        --sync-repeats 5 --gap-prompts 16 --variant-timeout 200 --out "$OUT/fp8_rollout_7b.json"
    ;;
  quant)
    # the quantizing sync's Triton kernel: its GPU test, its kernels against the plain copy, then FP8 rollout at the
    # Qwen2.5-7B architecture against bf16 (the in-place sync's time, generation, the log-prob gap)
    python3 -m pytest -q -x tests/gpu/test_fp8_quant_gpu.py -p no:warnings > "$OUT/test_fp8_quant.log" 2>&1
    tail -5 "$OUT/test_fp8_quant.log" | tee -a "$LOG"
    run timeout 120 python3 benchmarks/bench_fp8_quantizer_gpu.py --out "$OUT/fp8_quantizer_7b_linears.json"
    run timeout ${FP8_TIMEOUT:-330} python3 benchmarks/bench_fp8_rollout_gpu.py --variants bf16,fp8 \
        --sync-repeats 5 --gap-prompts 16 --variant-timeout 160 --out "$OUT/fp8_rollout_7b.json"
    ;;
  stream20)
    # streamed rewards with a 20 ms-per-sample reward and one reward worker: the engine alone, then the PPO step
    run timeout 150 python3 benchmarks/diag_stream_gpu.py --modes generate,step,step+score,step+score-async \
        --workers 1 --reward-delay-ms 20 --repeats 2 --json "$OUT/diag_stream_reward20ms.json"
    run timeout ${STREAM_TIMEOUT:-400} torchrun --nproc-per-node 1 benchmarks/bench_colocated_streaming.py \
        --prompts 32 --pairs ${PAIRS:-3} --modes sync,stream-reward --reward-delay-ms 20 \
        --out "$OUT/colocated_streaming_reward20ms.json"
    ;;
  streamrule)
    # streamed rewards with the rule reward: PPO at 1.5B, `off` and `reward` alternating, three batches
    run timeout ${STREAM_TIMEOUT:-380} torchrun --nproc-per-node 1 benchmarks/bench_colocated_streaming.py \
        --prompts 32 --pairs ${PAIRS:-3} --modes sync,stream-reward --out "$OUT/colocated_streaming_rule.json"
    ;;
  fp8tests)
    # the FP8 sync job on CUDA vLLM, with and without an FP8 KV cache (-s: each case's gap as a JSON line)
    python3 -m pytest -q -s tests/gpu/test_fp8_rollout_gpu.py -k test_fp8_sync_generation_and_gap -p no:warnings \
        > "$OUT/test_fp8_rollout.log" 2>&1
    grep '"lp_diff_mean"\|passed\|failed' "$OUT/test_fp8_rollout.log" | tee -a "$LOG"
    ;;
  kv8)
    # FP8 weights with and without an FP8 KV cache at 7B (the KV-cache scales set to 1.0), bf16 beside them
    run timeout ${FP8_TIMEOUT:-560} python3 benchmarks/bench_fp8_rollout_gpu.py --variants bf16,fp8,fp8_kv8 \
        --sync-repeats 5 --gap-prompts 16 --variant-timeout 180 --out "$OUT/fp8_rollout_7b_kv8.json"
    ;;
  kv8long)
    # the same three variants on long contexts (1,024-token prompts, lengths median 2,048 capped at 8,192, 64
    # requests): the regime where a decode step reads more KV cache than weights
    run timeout ${FP8_TIMEOUT:-585} python3 benchmarks/bench_fp8_rollout_gpu.py --variants bf16,fp8,fp8_kv8 \
        --prompts 64 --prompt-len 1024 --median 2048 --cap 8192 --sync-repeats 3 --gap-prompts 8 \
        --variant-timeout 190 --out "$OUT/fp8_rollout_7b_kv8_long.json"
    ;;
  grpo7lora)
    # a GRPO step at the Qwen2.5-7B architecture on one GPU: LoRA r=16 (merged into vLLM), configuration C's batch
    # (16 prompts × 8, lognormal ≤ 1024, packed); one rollout precision per call: GRPO_Q=none|fp8; GRPO_EXTRA adds
    # overrides (e.g. rollout.engine_kwargs.compilation_config.custom_ops=[+quant_fp8]) and GRPO_TAG names the JSON
    run timeout ${GRPO_TIMEOUT:-560} torchrun --nproc-per-node 1 benchmarks/bench_grpo_gpu.py --arch 7b --gen-tp 1 \
        --response-length 1024 --prompts 16 --lengths lognormal --warmup 1 --baseline-steps 0 --steps 3 \
        --out "$OUT/grpo_7b_lora_${GRPO_Q:-none}${GRPO_TAG:-}.json" parallel.tp=1 model.use_remove_padding=true \
        actor.use_dynamic_bsz=true actor.max_tokens_per_gpu=16384 actor.micro_batch_size_per_gpu=16 \
        actor.log_prob_micro_batch_size_per_gpu=16 model.lora.rank=16 rollout.quantization=${GRPO_Q:-none} ${GRPO_EXTRA:-}
    ;;
  marlin)
    # FP8 kernels at 7B on the long-tailed workload and a small batch: vLLM's W8A8 (cutlass) against its
    # weight-only Marlin kernel, bf16 beside them; one fresh process each. MARLIN_FORMATS picks a subset.
    run timeout ${FP8_TIMEOUT:-560} python3 benchmarks/probe_rollout_gpu.py fp8 --model 7b --repeats 1 \
        --formats ${MARLIN_FORMATS:-bf16,fp8-channel,fp8-channel+marlin} --json "$OUT/probe_marlin_7b.json"
    ;;
  cq)
    # FP8 at 7B with the activations' per-token quantization by vLLM's CUDA op (and its RMSNorm + quant fusion)
    # against Inductor's kernels, bf16 beside them; the probe writes its JSON after every format
    run timeout ${FP8_TIMEOUT:-560} python3 benchmarks/probe_rollout_gpu.py fp8 --model 7b --repeats 1 \
        --formats ${CQ_FORMATS:-fp8-channel+cq,fp8-channel,bf16} --json "$OUT/probe_cq_7b.json"
    ;;
  blockcq)
    # 128 x 128 block FP8 at 7B with vLLM's CUDA quant op: its fusion passes fuse both the RMSNorms and the SiLU with
    # a 128-group activation quantization (the per-channel format gets only the first), against per-channel and bf16
    run timeout ${FP8_TIMEOUT:-560} python3 benchmarks/probe_rollout_gpu.py fp8 --model 7b --repeats 1 \
        --formats ${BLOCK_FORMATS:-fp8-block+cq,fp8-channel,bf16} --json "$OUT/probe_block_cq_7b.json"
    ;;
  cqrollout)
    # the same through the rollout (the in-place quantizing sync, the log-prob gap): FP8 weights + FP8 KV cache with
    # and without vLLM's quant op, bf16 beside them (CQ_VARIANTS picks others)
    run timeout ${FP8_TIMEOUT:-585} python3 benchmarks/bench_fp8_rollout_gpu.py --variants ${CQ_VARIANTS:-fp8_kv8_cq,fp8_kv8,bf16} \
        --sync-repeats 3 --gap-prompts 16 --variant-timeout 190 --out "$OUT/fp8_rollout_7b_cq.json"
    ;;
  graphsync)
    # the colocated sync's copy plan as a CUDA graph: the FP8 GPU tests (three syncs, the third a replay, exact codes),
    # then the 7B sync, graph against one launch per copy, bf16 and FP8 (a short generation only)
    run timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -s tests/gpu/test_fp8_rollout_gpu.py -p no:warnings
    run timeout ${FP8_TIMEOUT:-280} python3 benchmarks/bench_fp8_rollout_gpu.py --variants ${SYNC_VARIANTS:-bf16,fp8} \
        --prompts 32 --median 128 --cap 512 --sync-repeats 5 --gap-prompts 4 --variant-timeout 140 \
        --out "$OUT/fp8_sync_graph_7b.json"
    ;;
  decode)
    # a decode step's wall time against the GPU's busy time, per batch size, bf16 and FP8 at 7B
    run timeout ${FP8_TIMEOUT:-560} python3 benchmarks/probe_rollout_gpu.py decode --model 7b \
        --formats ${DECODE_FORMATS:-bf16,fp8-channel} --json "$OUT/probe_decode_7b.json"
    ;;
  grpoC1old)
    # GRPO configuration C on one GPU beside the HF-generate baseline: the timed steps with the old log-probs' own
    # pass, then the same batches with them from the update (bench_grpo_gpu.py --old-logprobs both)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1
    run timeout ${GRPO_TIMEOUT:-560} torchrun --nproc-per-node 1 benchmarks/bench_grpo_gpu.py --gen-tp 1 \
        --response-length 1024 --prompts 16 --lengths lognormal --warmup 1 --baseline-steps 1 --steps ${STEPS:-3} \
        --old-logprobs both --out "$OUT/grpo_C1_old_logprobs.json" parallel.tp=1 model.use_remove_padding=true \
        actor.use_dynamic_bsz=true actor.max_tokens_per_gpu=16384 actor.micro_batch_size_per_gpu=16 \
        actor.log_prob_micro_batch_size_per_gpu=16
    ;;
  grpoC1)
    # GRPO configuration C on one GPU (1.5B, 16 prompts × 8, lognormal ≤ 1024, packed), bf16 rollout vs FP8 rollout
    for q in none fp8; do
      run timeout ${GRPO_TIMEOUT:-280} torchrun --nproc-per-node 1 benchmarks/bench_grpo_gpu.py --gen-tp 1 \
          --response-length 1024 --prompts 16 --lengths lognormal --warmup 1 --baseline-steps 0 --steps 3 \
          --out "$OUT/grpo_C1_$q.json" parallel.tp=1 model.use_remove_padding=true actor.use_dynamic_bsz=true \
          actor.max_tokens_per_gpu=16384 actor.micro_batch_size_per_gpu=16 actor.log_prob_micro_batch_size_per_gpu=16 \
          rollout.quantization=$q
    done
    ;;
esac
