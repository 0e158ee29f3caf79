#!/usr/bin/env bash
# Trains with torchrun. No arguments: configs/debug.toml on the bundled corpus.
#   ./run_train.sh --config configs/bloom-560m.toml --training.steps=100
#   NPROC=8 ./run_train.sh --parallelism.tp=2 --parallelism.pp=2 --training.micro_batch_size=1
# NPROC (default 1) is the number of processes on this node (NNODES nodes; multi-node runs also
# set RDZV_ENDPOINT=host:port); MAX_RESTARTS (default 3) is passed to torchrun so a crashed rank
# restarts the job, which resumes from the newest checkpoint that verifies.
# SIGTERM or SIGINT (Ctrl-C) stops the run cleanly: the workers finish their step, save and exit,
# and so does this command, with code 0. STOP_GRACE_S (default 120) is how long they get before
# they are killed; keep it below the scheduler's own grace period (Kubernetes'
# terminationGracePeriodSeconds, SLURM's KillWait).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh
NPROC="${NPROC:-1}"
NNODES="${NNODES:-1}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
# Config, layout and data files are checked here, once, before any process is started.
"$BLOOMNATIVE_PYTHON" -m bloomnative.train.preflight --world-size "$(( NPROC * NNODES ))" "$@"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
if [ "$NNODES" = 1 ]; then
  rendezvous=(--standalone)
else
  rendezvous=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port for multi-node runs}")
fi
exec "$BLOOMNATIVE_PYTHON" -m bloomnative.train.launch ${STOP_GRACE_S:+"--stop-grace-s=$STOP_GRACE_S"} \
  "${rendezvous[@]}" --nproc-per-node="$NPROC" --max-restarts="$MAX_RESTARTS" \
  -m bloomnative.train.main "$@"
