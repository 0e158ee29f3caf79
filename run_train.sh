#!/usr/bin/env bash
# Trains with torchrun. No arguments: configs/debug.toml on the bundled corpus.
#   ./run_train.sh --config configs/bloom-560m.toml --training.steps=100
#   NPROC=8 ./run_train.sh --parallelism.tp=2 --parallelism.pp=2
# NPROC (default 1) is the number of processes on this node; MAX_RESTARTS (default 0) is passed
# to torchrun so a crashed rank restarts the job, which resumes from the last complete checkpoint.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/ensure_env.sh
NPROC="${NPROC:-1}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}"
exec "$BLOOMNATIVE_PYTHON" -m torch.distributed.run \
  --standalone --nproc-per-node="$NPROC" --max-restarts="$MAX_RESTARTS" \
  -m bloomnative.train.main "$@"
