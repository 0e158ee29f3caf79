#!/usr/bin/env bash
# Trains with torchrun. No arguments: configs/debug.toml on the bundled corpus.
#   ./run_train.sh --config configs/bloom-560m.toml --training.steps=100
#   NPROC=8 ./run_train.sh --parallelism.tp=2 --parallelism.pp=2 --training.micro_batch_size=1
# Relative paths (--config, data, dump folder) are relative to the directory you run it from.
# NPROC (default 1) is the number of processes on this node (NNODES nodes, or an elastic range
# min:max that goes on with fewer nodes when it loses one; multi-node runs also set
# RDZV_ENDPOINT=host:port; RDZV_LAST_CALL_S, default 30, is how long an elastic rendezvous waits
# for more nodes once min have joined); MAX_RESTARTS (default 3) is how often a crashed or lost
# rank restarts the job, which resumes from the newest checkpoint that verifies. An error a
# restart cannot fix is not retried: one line, exit 2 (a configuration, data or checkpoint error,
# no W&B API key for metrics.wandb online, a disk without room for the next checkpoint, too many
# non-finite steps in a row, a loss spike that cannot be rolled back: docs/checkpointing.md,
# "Exit codes").
# A lost node is named within seconds and may rejoin by running this again on it; the loss of the
# rendezvous store's node, or a node not back within job.collective_timeout_s: exit 3
# (docs/cluster.md, "Losing a node").
# SIGTERM or SIGINT (Ctrl-C) stops the run cleanly: the workers finish their step, save and exit,
# and so does this command, with code 0. STOP_GRACE_S (default 120) is how long they get before
# they are killed; keep it below the scheduler's own grace period (Kubernetes'
# terminationGracePeriodSeconds, SLURM's KillWait).
# The variables are checked (whole numbers; NNODES also min:max) by bloomnative.launch.cli, which
# runs the preflight checks and then torchrun; nothing here evaluates them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/ensure_env.sh"
exec "$BLOOMNATIVE_PYTHON" -m bloomnative.launch.cli "$@"
