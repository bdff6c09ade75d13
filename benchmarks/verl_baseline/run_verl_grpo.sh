#!/usr/bin/env bash
# verl 0.9.1 GRPO baseline on the lent 2×H200 machine, at verl_mega's "config C" (BENCHMARKS.md): Qwen2.5-1.5B
# architecture with random weights, 16 prompts × 8 samples, every response exactly 1024 tokens (ignore_eos, as
# verl_mega's benchmark does), KL loss against a reference (0.001, low_var_kl), lr 1e-6, one optimizer step per RL
# step, token-budget micro-batches of 12,288 tokens per GPU. verl side: FSDP2 actor + reference on both GPUs, vLLM
# rollout (async server mode, hybrid engine: sleeps while the actor trains) at tp=1, i.e. two vLLM replicas.
#
# Needs /tmp/site (kit), /tmp/site_ray (Ray) and /tmp/site_verl (stage_verl.sh) installed first; see README.md.
#   bash benchmarks/verl_baseline/run_verl_grpo.sh              # on the GPU machine; results in $OUT
#   CFG_ONLY=1 bash benchmarks/verl_baseline/run_verl_grpo.sh   # print verl's composed config and exit (no GPU)
#   CHECK_ONLY=1 bash benchmarks/verl_baseline/run_verl_grpo.sh # build inputs, check config/dataset/reward (no GPU)
# Knobs (env): STEPS (4: 1 warm-up + 3 timed), WARMUP (1), GEN_TP (1), PROMPTS (16), N (8), RESP_LEN (1024),
#   MAX_TOK_PER_GPU (12288), GPU_MEM_UTIL (0.35), GC (False: gradient checkpointing), STRATEGY (fsdp2),
#   VERL_TIMEOUT (500 s for main_ppo), TINY (0; 1 = 2-layer model), EXTRA (more hydra overrides, space-separated),
#   PREPARE_ONLY=1 (build the model + dataset under $VERL_WORK=/tmp/verl_bench and stop; they persist in /tmp),
#   OURS_JSON (verl_mega's bench_grpo_gpu.py JSON of the same workload: the summary then gives the ratios).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${OUT:-/tmp/verl_out}
mkdir -p "$OUT"
WORK=${VERL_WORK:-/tmp/verl_bench}
TINY=${TINY:-0}
MODEL=$WORK/$([ "$TINY" = 1 ] && echo tiny-random-char || echo qwen2.5-1.5b-random-char)
DATA=$WORK/data
STEPS=${STEPS:-4}; WARMUP=${WARMUP:-1}; GEN_TP=${GEN_TP:-1}; PROMPTS=${PROMPTS:-16}; N=${N:-8}
RESP_LEN=${RESP_LEN:-1024}; MAX_TOK_PER_GPU=${MAX_TOK_PER_GPU:-12288}; GPU_MEM_UTIL=${GPU_MEM_UTIL:-0.35}
GC=${GC:-False}; STRATEGY=${STRATEGY:-fsdp2}; NGPUS=${NGPUS:-2}

for d in /tmp/site /tmp/site_ray /tmp/site_verl; do [ -d "$d" ] && PP="${PP:+$PP:}$d"; done
export PYTHONPATH="${PP:+$PP:}$ROOT:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled HF_DATASETS_CACHE=$WORK/hf_datasets_cache RAY_DEDUP_LOGS=0 \
       VERL_FILE_LOGGER_PATH=$OUT/verl_metrics.jsonl
unset VLLM_ENABLE_V1_MULTIPROCESSING  # verl runs vLLM's AsyncLLM with its engine-core process

OVERRIDES=(
  algorithm.adv_estimator=grpo
  algorithm.use_kl_in_reward=False
  "data.train_files=$DATA/train.parquet"
  "data.val_files=$DATA/train.parquet"
  data.train_batch_size=$PROMPTS
  data.max_prompt_length=64
  data.max_response_length=$RESP_LEN
  data.filter_overlong_prompts=False
  data.truncation=error
  data.shuffle=False
  data.dataloader_num_workers=0
  "actor_rollout_ref.model.path=$MODEL"
  # flash-attn is not on the machine: HF SDPA, on padded micro-batches (remove-padding packs sequences, which only
  # flash-attn's varlen path keeps apart; SDPA would attend across them)
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa
  actor_rollout_ref.model.use_remove_padding=False
  actor_rollout_ref.model.enable_gradient_checkpointing=$GC
  actor_rollout_ref.actor.strategy=$STRATEGY
  actor_rollout_ref.ref.strategy=$STRATEGY
  actor_rollout_ref.actor.optim.lr=1e-6
  actor_rollout_ref.actor.ppo_mini_batch_size=$PROMPTS
  actor_rollout_ref.actor.ppo_epochs=1
  actor_rollout_ref.actor.use_dynamic_bsz=True
  actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$MAX_TOK_PER_GPU
  actor_rollout_ref.actor.use_kl_loss=True
  actor_rollout_ref.actor.kl_loss_coef=0.001
  actor_rollout_ref.actor.kl_loss_type=low_var_kl
  actor_rollout_ref.actor.entropy_coeff=0
  actor_rollout_ref.actor.fsdp_config.param_offload=False
  actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
  actor_rollout_ref.ref.fsdp_config.param_offload=False
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.mode=async
  actor_rollout_ref.rollout.tensor_model_parallel_size=$GEN_TP
  actor_rollout_ref.rollout.n=$N
  actor_rollout_ref.rollout.temperature=1.0
  actor_rollout_ref.rollout.ignore_eos=True
  actor_rollout_ref.rollout.gpu_memory_utilization=$GPU_MEM_UTIL
  actor_rollout_ref.rollout.enforce_eager=False
  actor_rollout_ref.rollout.free_cache_engine=True
  actor_rollout_ref.rollout.agent.num_workers=4
  transfer_queue.backend.SimpleStorage.num_data_storage_units=2
  "reward.custom_reward_function.path=$HERE/reward_arith.py"
  reward.custom_reward_function.name=compute_score
  reward.num_workers=2
  trainer.critic_warmup=0
  'trainer.logger=["console","file"]'
  trainer.project_name=verl_baseline
  trainer.experiment_name=grpo_config_c
  trainer.nnodes=1
  trainer.n_gpus_per_node=$NGPUS
  trainer.val_before_train=False
  trainer.test_freq=-1
  trainer.save_freq=-1
  trainer.resume_mode=disable
  trainer.total_epochs=1
  trainer.total_training_steps=$STEPS
  "trainer.default_local_dir=$WORK/ckpt"
)
# shellcheck disable=SC2206
[ -n "${EXTRA:-}" ] && OVERRIDES+=($EXTRA)

if [ "${CFG_ONLY:-0}" = 1 ]; then
  exec python3 -m verl.trainer.main_ppo --cfg job "${OVERRIDES[@]}"
fi
if [ "${CHECK_ONLY:-0}" = 1 ]; then  # no GPU, no Ray: inputs + config + verl's dataset/tokenizer/reward path
  python3 "$HERE/prepare_verl_inputs.py" --model-dir "$MODEL" --data-dir "$DATA" --num-prompts 1024 \
      $([ "$TINY" = 1 ] && echo --tiny) 2>&1 | grep -v "Writing model shards" || exit 1
  exec python3 "$HERE/check_verl_setup.py" "${OVERRIDES[@]}"
fi

{
  date -u +"start %FT%TZ"
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1
  python3 -c "import torch, vllm, transformers, ray, verl, tensordict; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__, 'verl', verl.__version__, 'tensordict', tensordict.__version__)" 2>&1 | grep -v -i warn
} | tee "$OUT/env.txt"

python3 "$HERE/prepare_verl_inputs.py" --model-dir "$MODEL" --data-dir "$DATA" --num-prompts 1024 \
    $([ "$TINY" = 1 ] && echo --tiny) 2>&1 | grep -v "Writing model shards" | tee -a "$OUT/env.txt" || exit 1
[ "${PREPARE_ONLY:-0}" = 1 ] && exit 0

T0=$(date +%s)
rm -f "$OUT/verl_metrics.jsonl"
timeout -k 20 "${VERL_TIMEOUT:-500}" python3 -m verl.trainer.main_ppo "${OVERRIDES[@]}" > /tmp/verl_run.log 2>&1
RC=$?
echo "main_ppo exit code $RC after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/env.txt"
# the whole log can be large (config dump, Ray worker output): keep its head and tail, and every error line
{ head -n 300 /tmp/verl_run.log; echo "..."; grep -n -i -E "error|exception|traceback" /tmp/verl_run.log | head -200;
  echo "..."; tail -n 1500 /tmp/verl_run.log; } > "$OUT/verl_run_log.txt"
python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1  # a killed driver can leave raylet & co. behind

python3 "$HERE/extract_verl_metrics.py" --metrics "$OUT/verl_metrics.jsonl" --log /tmp/verl_run.log \
    --warmup "$WARMUP" --n-gpus "$NGPUS" --rc "$RC" ${OURS_JSON:+--ours "$OURS_JSON"} \
    --setup "prompts=$PROMPTS n=$N response_length=$RESP_LEN gen_tp=$GEN_TP strategy=$STRATEGY gc=$GC max_tok_per_gpu=$MAX_TOK_PER_GPU" \
    --out "$OUT/verl_grpo.json"
tail -n 25 /tmp/verl_run.log | grep -v "^\s*$" | tail -n 12
exit $RC
