#!/usr/bin/env bash
# Rehearse scripts/slurm/train_ddp.sbatch on this machine before queueing it (lesson 07).
#
#   bash scripts/slurm/rehearse.sh            two "nodes" x 1 CPU worker, digits, quick, 1 epoch
#   NPROC_PER_NODE=2 EXTRA_ARGS="--quick --epochs 2" bash scripts/slurm/rehearse.sh
#
# The real batch script runs, unchanged, with stand-ins for srun and scontrol first on the PATH
# (scripts/slurm/fake/): the "nodes" are two names for this machine (127.0.0.1 and localhost),
# srun starts one torchrun per node at once and labels their lines "0: " and "1: ", and the two
# agents meet on 127.0.0.1 as they would on the first node of a real job. Everything lands in
# REHEARSAL_DIR (default build/slurm-rehearsal): snapshot.pt, result.json, model.pt; those of
# an earlier rehearsal are deleted first, so that it starts afresh instead of resuming.
# FAKE_TIME_LIMIT (default 300 s) stops a rehearsal that hangs, as --time would.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${REHEARSAL_DIR:-$root/build/slurm-rehearsal}
mkdir -p "$out"
# -r: scripts/train_lm.py's snapshot is a folder (TRAIN_SCRIPT=scripts/train_lm.py rehearses it)
rm -rf "$out"/snapshot.pt "$out"/snapshot.pt.* "$out"/result.json "$out"/model.pt

# The batch script's own choice of Python (the course's .venv when there is one).
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$root/.venv/bin/python" ]; then PYTHON=$root/.venv/bin/python; else PYTHON=python3; fi
fi
port=${RDZV_PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

# What SLURM would have set for a 2-node job submitted from the course's folder.
export PATH="$here/fake:$PATH"
export SLURM_JOB_ID=${SLURM_JOB_ID:-4242} SLURM_JOB_NAME=rehearsal SLURM_JOB_NUM_NODES=2
export SLURM_JOB_NODELIST="127.0.0.1,localhost" SLURM_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
export SLURM_SUBMIT_DIR="$root" FAKE_NODES="127.0.0.1 localhost"
unset SLURM_GPUS_PER_NODE
# This machine's settings for the script: one CPU worker per node unless told otherwise.
export PYTHON RDZV_PORT=$port RUN_DIR=$out COURSE_DIR=$root
export NPROC_PER_NODE=${NPROC_PER_NODE:-1} DEVICE=${DEVICE:-cpu}
export EXTRA_ARGS=${EXTRA_ARGS:---dataset digits --quick --epochs 1}
echo "rehearsal: 2 nodes on this machine, rendezvous 127.0.0.1:$port, results in $out"
bash "$root/scripts/slurm/train_ddp.sbatch"
ls "$out"
