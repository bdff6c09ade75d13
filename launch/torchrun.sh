#!/usr/bin/env bash
# Start verl_mega (or any Python entry point) with torchrun, on one node or many.
#
#   launch/torchrun.sh [--nnodes N] [--node-rank R] [--nproc-per-node P] [--rdzv-endpoint HOST:PORT]
#                      [--rdzv-backend c10d|static] [--rdzv-id ID] [--local-addr ADDR] [--max-restarts K]
#                      [--] [PYTHON_ARGS...]
# PYTHON_ARGS default to `-m verl_mega.train`; if they do not start with -m or a *.py file they are passed as
# arguments to `-m verl_mega.train` (so `-- --config x.yaml` works). Run the same command on every node, changing
# only --node-rank. --local-addr is the address other nodes use to reach this one (default: its hostname).
# A rank that fails stops its worker group; torchrun restarts the group up to --max-restarts times (default 3, 0 to
# fail at once) and the job resumes from its newest checkpoint (docs/fault_tolerance.md). Environment fallbacks:
# NNODES, NODE_RANK, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT, RDZV_ID, LOCAL_ADDR, MAX_RESTARTS. With --rdzv-backend
# c10d (default for several nodes) torchrun numbers nodes in arrival order; --rdzv-backend static pins node ranks.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-}"
RDZV_ENDPOINT=""
RDZV_BACKEND=""
RDZV_ID="${RDZV_ID:-verl_mega}"
LOCAL_ADDR="${LOCAL_ADDR:-}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) NNODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --nproc-per-node) NPROC_PER_NODE="$2"; shift 2 ;;
    --rdzv-endpoint) RDZV_ENDPOINT="$2"; shift 2 ;;
    --rdzv-backend) RDZV_BACKEND="$2"; shift 2 ;;
    --rdzv-id) RDZV_ID="$2"; shift 2 ;;
    --local-addr) LOCAL_ADDR="$2"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch.distributed.run" 2>/dev/null; then
  echo "torchrun.sh: error: '$PYTHON -m torch.distributed.run' is unavailable: install PyTorch (pip install torch)" >&2
  exit 2
fi

if [[ -z "$NPROC_PER_NODE" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') && [[ "$n" -gt 0 ]]; then
    NPROC_PER_NODE="$n"
  else
    NPROC_PER_NODE=1
  fi
fi

# Program: explicit `-m module ...` / `script.py ...`, else arguments for the default entry point.
if [[ $# -eq 0 ]]; then
  PROG=(-m verl_mega.train)
elif [[ "$1" == "-m" || "$1" == *.py ]]; then
  PROG=("$@")
else
  PROG=(-m verl_mega.train "$@")
fi

if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "torchrun.sh: error: --max-restarts $MAX_RESTARTS is not a count: give 0 or more" >&2
  exit 2
fi
ARGS=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS")
[[ -n "$LOCAL_ADDR" ]] && ARGS+=(--local-addr "$LOCAL_ADDR")
if [[ "$NNODES" == "1" && -z "$RDZV_ENDPOINT" ]]; then
  ARGS+=(--standalone)
else
  RDZV_ENDPOINT="${RDZV_ENDPOINT:-${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}}"
  RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
  if [[ "$RDZV_BACKEND" == "static" ]]; then
    ARGS+=(--node-rank "$NODE_RANK" --master-addr "${RDZV_ENDPOINT%:*}" --master-port "${RDZV_ENDPOINT##*:}")
  else
    ARGS+=(--node-rank "$NODE_RANK" --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
  fi
fi

# A recipe that does not load fails the same way on every attempt: check it once, here, and print its error once
# instead of starting (and restarting) the job with it.
if [[ "${PROG[0]}" == "-m" && "${PROG[1]:-}" == "verl_mega.train" ]]; then
  "$PYTHON" "${PROG[@]}" --check || exit $?
fi

export VERL_MEGA_LAUNCHER=torchrun
exec "$PYTHON" -m torch.distributed.run "${ARGS[@]}" "${PROG[@]}"
